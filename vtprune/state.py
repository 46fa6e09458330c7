"""Per-forward bookkeeping of the engine: the layout each layer sees, and the recorded statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vtprune.adapters.base import VisualSegment
from vtprune.layout import Layout, gather_tokens, repad


@dataclass
class CallStats:
    """What one prefill did: visual tokens per sample before pruning and kept after each stage.

    ``kept_indices[s][b]`` lists the visual tokens of sample ``b`` alive after stage ``s``, as ordinals in
    the sample's visual tokens (grid order: row-major per image, images in prompt order).
    """

    visual_tokens: list[int]
    stage_layers: list[int] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    kept_indices: list[list[list[int]]] = field(default_factory=list)
    forward_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "visual_tokens": self.visual_tokens,
            "stage_layers": self.stage_layers,
            "kept": self.kept,
            "kept_indices": self.kept_indices,
            "forward_ms": self.forward_ms,
        }


@dataclass
class StageView:
    """The sequence seen by the layers of one stage, relative to the language model's input.

    ``index`` ``[B, L_s]`` points into the LM input positions, ``valid`` marks real slots; ``kwargs``
    caches the sliced layer arguments (mask, cos/sin, position ids) built once per stage.
    """

    index: torch.Tensor
    valid: torch.Tensor
    visual: torch.Tensor
    ordinal: torch.Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CallState:
    """Everything the hooks share during one prefill and the decode steps that follow it."""

    num_visual: torch.Tensor
    segments: list[list[VisualSegment]]
    inputs: dict[str, Any]
    visual: torch.Tensor
    ordinal: torch.Tensor
    prompt_length: int
    stats: CallStats
    left_padding: bool = True
    cache: Any = None
    decoding: bool = False
    decoded: int = 0
    lm_valid: torch.Tensor | None = None
    pre_llm_index: torch.Tensor | None = None
    pre_llm_valid: torch.Tensor | None = None
    views: list[StageView] = field(default_factory=list)
    base_count: torch.Tensor | None = None
    next_stage: int = 0
    pending_scores: torch.Tensor | None = None
    decode_columns: torch.Tensor | None = None
    method_state: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0

    @property
    def view(self) -> StageView | None:
        """The view of the deepest stage reached so far (prefill)."""
        return self.views[-1] if self.views else None


def visual_ordinals(visual: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` long: the index of each visual slot among its sample's visual tokens, ``-1`` elsewhere."""
    ordinal = visual.long().cumsum(dim=1) - 1
    return torch.where(visual, ordinal, torch.full_like(ordinal, -1))


def select_keep(
    scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Keep mask ``[B, L]``: every valid text slot plus the top ``counts[b]`` alive visual slots by score.

    scores: ``[B, L]`` float; visual / valid: ``[B, L]`` bool; counts: ``[B]`` long. Ties go to the
    earlier token (``vtprune.kernels.segmented_topk``).
    """
    from vtprune.kernels import segmented_topk

    batch, length = visual.shape
    alive = visual & valid
    lengths = alive.sum(dim=1)
    width = max(int(lengths.max()) if batch else 0, 1)
    order = torch.sort((~alive).to(torch.int8), dim=1, stable=True).indices[:, :width]
    slot_valid = torch.arange(width, device=visual.device)[None, :] < lengths[:, None]
    packed = torch.gather(scores.float(), 1, order).masked_fill(~slot_valid, 0.0)
    k = torch.minimum(counts.to(lengths.device), lengths)
    chosen = segmented_topk(packed, lengths, k)
    keep = valid & ~visual
    picked = chosen >= 0
    rows = torch.arange(batch, device=visual.device)[:, None].expand_as(chosen)
    positions = torch.gather(order, 1, chosen.clamp(min=0))
    keep[rows[picked], positions[picked]] = True
    return keep


def next_view(view: StageView, keep: torch.Tensor, left: bool) -> StageView:
    """Compose ``view`` with a keep mask over its slots into the view of the next stage."""
    layout: Layout = repad(keep, left)
    return StageView(
        index=torch.gather(view.index, 1, layout.index),
        valid=layout.valid,
        visual=torch.gather(view.visual, 1, layout.index) & layout.valid,
        ordinal=torch.where(layout.valid, torch.gather(view.ordinal, 1, layout.index), -1),
    )


def gather_view(tensor: torch.Tensor, view: StageView, dim: int = 1) -> torch.Tensor:
    """Slice a per-position tensor of the LM input (``[B, L, ...]`` or ``[.., B, L]``) to ``view``."""
    return gather_tokens(tensor, view.index, dim)
