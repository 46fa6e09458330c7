"""What a criterion sees when it scores visual tokens, and the attention rows it can ask for.

Attention is recomputed from the scoring layer's own q/k projections and rotary embedding for a few
query positions (``vtprune.kernels.visual_attention_scores``), so the model keeps running SDPA or
FlashAttention and no ``L x L`` matrix is ever built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vtprune.adapters.base import Adapter, VisualSegment
from vtprune.config import Stage
from vtprune.kernels import visual_attention_scores


@dataclass
class ScoreContext:
    """Inputs of one scoring call, for the current (possibly already pruned) sequence of ``L`` slots.

    Attributes
    ----------
    hidden: ``[B, L, D]`` input hidden states of ``layer``.
    layer_index / layer: the decoder layer whose projections score (``-1`` / None for the pre-LLM stage).
    position_embeddings: ``(cos, sin)`` ``[B, L, d]`` for the current slots (None for the pre-LLM stage).
    valid: ``[B, L]`` bool, False on padding.
    visual: ``[B, L]`` bool, True on alive visual tokens.
    ordinal: ``[B, L]`` long, the visual token's index in the sample's original visual tokens (grid order),
        ``-1`` elsewhere.
    num_visual: ``[B]`` long, original visual-token count per sample (``N0``); ``visual_counts`` the same
        on the host (``list[int]``), to size tensors without reading the device.
    segments: per sample, its images / videos (grids) in visual-token order (computed on first use).
    inputs: the model call's keyword inputs (``pixel_values``, ``image_sizes``, grids ...).
    state: the call's scratch space (the scorer's captures land here; dropped when the prefill returns).
    stage: the stage being scored (``layer``, ``keep``).
    attention_filter: applied to every :meth:`attention` result (set by ``Debiased``).
    count_rule: ``(keep, n) -> kept count``, the plan's rounding rule (:meth:`vtprune.plan.Plan.count`; set by the
        engine at every stage): :meth:`kept_count` gives a group's quota from it.
    planned: the stage's kept count of each sample, as the plan counted it (``list[int]``; set by the engine):
        :meth:`sample_kept_count`.
    rounding: the plan's ``"sample"`` or ``"per_image"`` counting (under ``"per_image"`` every image and video
        frame keeps its own share, as the vLLM plugin must).
    """

    hidden: torch.Tensor
    layer_index: int
    layer: nn.Module | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    valid: torch.Tensor
    visual: torch.Tensor
    ordinal: torch.Tensor
    num_visual: torch.Tensor
    segments: list[list[VisualSegment]]
    adapter: Adapter
    inputs: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    visual_counts: list[int] | None = None
    stage: Stage | None = None
    stage_index: int = 0
    attention_filter: Callable[[ScoreContext, torch.Tensor], torch.Tensor] | None = None
    count_rule: Callable[[float, int], int] | None = None
    planned: list[int] | None = None
    rounding: str = "sample"

    def __post_init__(self) -> None:
        if self.visual_counts is None:
            self.visual_counts = [int(n) for n in self.num_visual.tolist()]

    def kept_count(self, n: int, keep: float | None = None) -> int:
        """Visual tokens kept of ``n`` original ones at ``keep`` (default: the stage's), by the plan's rule: the
        quota of a group (a frame, an image) counted as the engine counts a sample's kept tokens."""
        if self.count_rule is None or (keep is None and self.stage is None):
            raise RuntimeError("this ScoreContext has no stage to count for (the engine sets the stage and the "
                               "plan's count_rule when it scores a stage).")
        return self.count_rule(self.stage.keep if keep is None else keep, n)

    def sample_kept_count(self, row: int) -> int:
        """Visual tokens sample ``row`` keeps at this stage: the plan's count (under ``rounding="per_image"`` the sum
        of its images' counts), else :meth:`kept_count` of its original visual tokens."""
        if self.planned is not None:
            return self.planned[row]
        return self.kept_count(self.visual_counts[row])

    def last_query(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Index ``[B, 1]`` of each sample's last valid slot (its last prompt token) and an all-True mask."""
        length = self.valid.shape[1]
        positions = torch.arange(length, device=self.valid.device).expand_as(self.valid)
        last = torch.where(self.valid, positions, torch.full_like(positions, -1)).max(dim=1).values
        return last[:, None], torch.ones_like(last[:, None], dtype=torch.bool)

    def instruction_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ``[B, Q]`` of the valid text slots after each sample's last visual token, and their mask."""
        length = self.valid.shape[1]
        positions = torch.arange(length, device=self.valid.device).expand_as(self.valid)
        last_visual = torch.where(self.visual, positions, torch.full_like(positions, -1)).max(dim=1).values
        chosen = self.valid & ~self.visual & (positions > last_visual[:, None])
        count = chosen.sum(dim=1)
        width = self.state.get("instruction_width")  # text is never pruned: read once per call
        if width is None:
            width = self.state["instruction_width"] = max(int(count.max()), 1)
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices[:, :width]
        mask = torch.arange(width, device=order.device)[None, :] < count[:, None]
        fallback, _ = self.last_query()
        index = torch.where(mask, order, fallback.expand_as(order))
        return index, mask | (count[:, None] == 0) & (torch.arange(width, device=order.device) == 0)

    def attention(self, queries: str = "last") -> torch.Tensor:
        """Head- and query-averaged attention ``[B, L]`` (fp32) that ``queries`` pay to every slot.

        ``queries`` is ``"last"`` (the last prompt token, FastV / PyramidDrop) or ``"instruction"`` (the
        text after the last visual token, TransPrune's IGA). Normalised over all keys, as the model does.
        """

        if self.layer is None or self.position_embeddings is None:
            raise RuntimeError("attention scores need a decoder layer; the pre-LLM stage has none.")
        index, mask = self.last_query() if queries == "last" else self.instruction_queries()
        query, key = self.adapter.project_qk(self.layer, self.hidden, self.position_embeddings, index)
        device = query.device  # the layer's device (accelerate may have placed it elsewhere)
        scores = visual_attention_scores(
            query,
            key,
            query_positions=index.to(device),
            key_valid=self.valid.to(device),
            query_valid=mask.to(device),
            scaling=float(getattr(self.layer.self_attn, "scaling", query.shape[-1] ** -0.5)),
            check=False,
        )
        scores = scores.to(self.valid.device)
        return scores if self.attention_filter is None else self.attention_filter(self, scores)

    def received_attention(self, rows: int | None = None, chunk: int = 256) -> torch.Tensor:
        """Head-averaged attention each slot receives, summed over query rows ``[B, L]`` (fp32; PrefixKV's priority).

        ``rows=None``: every valid prompt position queries (exact column sums, streamed ``chunk`` query rows at a
        time: no ``L x L`` matrix is kept); ``rows=n``: ``n`` evenly spaced valid positions of each sample, its
        last one included (an approximation that costs ``n`` rows).
        """
        if self.layer is None or self.position_embeddings is None:
            raise RuntimeError("attention scores need a decoder layer; the pre-LLM stage has none.")
        batch, length = self.valid.shape
        positions = torch.arange(length, device=self.valid.device).expand(batch, length)
        if rows is None:
            index, mask = positions, self.valid
        else:
            first = torch.where(self.valid, positions, length).min(dim=1).values
            count = self.valid.sum(dim=1)
            steps = torch.linspace(0, 1, max(int(rows), 1), device=self.valid.device)
            index = first[:, None] + (steps[None, :] * (count[:, None] - 1).clamp(min=0)).round().long()
            mask = torch.ones_like(index, dtype=torch.bool)
        query, key = self.adapter.project_qk(self.layer, self.hidden, self.position_embeddings, index)
        scaling = float(getattr(self.layer.self_attn, "scaling", query.shape[-1] ** -0.5))
        return received_attention_sum(query, key, index, mask, self.valid, scaling, chunk).to(self.valid.device)


def received_attention_sum(query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                           query_valid: torch.Tensor, key_valid: torch.Tensor, scaling: float, chunk: int = 256
                           ) -> torch.Tensor:
    """``[B, L]`` float32: the head-averaged causal attention each key receives, summed over the valid query rows.

    query ``[B, H, Q, d]`` (post-RoPE) at ``query_positions`` ``[B, Q]`` (a query sees the keys at or before its
    position), key ``[B, H_kv, L, d]``, masks ``[B, Q]`` / ``[B, L]`` bool. Streamed ``chunk`` rows at a time. The sum
    over rows splits over row subsets, so a prompt prefilled in chunks sums its chunks' results (the vLLM plugin).
    """
    device = query.device
    positions, query_valid, key_valid = query_positions.to(device), query_valid.to(device), key_valid.to(device)
    total = torch.zeros(key.shape[0], key.shape[2], dtype=torch.float32, device=device)
    for start in range(0, positions.shape[1], chunk):
        part = slice(start, start + chunk)
        mean = visual_attention_scores(query[:, :, part], key, query_positions=positions[:, part], key_valid=key_valid,
                                       query_valid=query_valid[:, part], scaling=scaling, check=False)
        total += mean * query_valid[:, part].sum(dim=1, keepdim=True)  # the kernel averages the rows: back to a sum
    return total
