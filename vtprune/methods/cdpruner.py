"""CDPruner (Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in
MLLMs", NeurIPS 2025, arXiv:2506.10967): the instruction-conditioned DPP subset of each image, before the LLM.

Per image (or frame), on the visual embeddings entering the language model ``x_i`` (``n`` of them):

1. **Similarity** ``S_ij = cos(x_i, x_j)``.
2. **Relevance** to the request's own instruction: ``r_i = mean_m cos(e_i, t_m)``, min-max normalised over the
   image's tokens as the release writes it, ``(r - min r + 1e-6) / (max r - min r)``.
3. **Conditional kernel** ``L_ij = q_i S_ij q_j`` with ``q = r`` (the release: its ``theta`` lines are commented
   out) or, with ``relevance_weight=theta`` in ``[0, 1)``, the paper's ``q = exp(alpha r)``,
   ``alpha = theta / (2 (1 - theta))`` (the release's commented rule, Chen et al.'s quality weighting).
4. **Fast greedy MAP** of the DPP (Chen et al., NeurIPS 2018): repeatedly the token with the largest remaining
   conditional gain ``d_j^2``, updated by Cholesky rows; the image keeps its first ``keep_count(keep, n)`` picks.
   When every gain is spent (``<= 1e-6`` of the largest diagonal: the kernel's rank is exhausted, possible when
   ``D < n``) the remaining tokens follow by relevance; the release would divide by ``sqrt`` of a spent gain.

Where ``e`` and ``t`` come from: the release (LLaVA) uses CLIP's projected patch embeddings and its text tower's
embeddings of the question, with ``-cos`` (CLIP's patch-text similarity is inverted on LLaVA); no model vtprune
embeds has a paired text tower, so ``e = x`` and ``t`` is the mean LM-input embedding of the instruction tokens
with ``+cos``, as OpenVINO GenAI's port does for Qwen-VL (its text: every non-visual prompt token; vtprune's:
the text after the sample's last visual token, the engine's instruction span). Each sample uses its own
instruction and each image its own normalisation: the release shares one question across a batch and
normalises over the whole batch, so a batch there differs from its samples alone (not here).
Attention-free; pre-LLM (stage at layer 0) on every family; a later stage (``schedule="2:0.25"``) reads the
captured LM input. The release selects per LLaVA-NeXT crop; vtprune per image (base view and tiles are
the groups of :func:`vtprune.methods.lm_inputs.group_ids`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext

SPENT = 1e-6  # a gain at or below this fraction of the largest diagonal is spent (the kernel's rank is exhausted)


# -- pure functions ----------------------------------------------------------------------------------------
def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``[n, D]`` divided by their L2 norm (fp32; a zero row stays zero)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def relevance(image: torch.Tensor, text: torch.Tensor, negate: bool = False) -> torch.Tensor:
    """Min-max normalised instruction relevance ``[n]`` (fp32) of one image's tokens.

    image ``[n, C]``, text ``[m, C]`` in the same space: ``r_i = mean_m cos(image_i, text_m)`` (``-cos`` with
    ``negate``, the release's CLIP rule), then ``(r - min + 1e-6) / (max - min)`` as the release normalises
    (over this image only). All equal (one token, no instruction): ones.
    """
    raw = (unit_rows(image) @ unit_rows(text).T).mean(dim=-1)
    raw = -raw if negate else raw
    low, span = raw.min(), raw.max() - raw.min()
    return torch.where(span > 0, (raw - low + 1e-6) / span.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(raw))


def conditional_kernel(features: torch.Tensor, quality: torch.Tensor, relevance_weight: float | None = None
                       ) -> torch.Tensor:
    """``[n, n]`` fp32 kernel ``q_i cos(x_i, x_j) q_j`` of features ``[n, D]`` and relevance ``[n]``.

    ``relevance_weight`` None: ``q = relevance`` (the release); ``theta`` in ``[0, 1)``: ``q = exp(alpha r)`` with
    ``alpha = theta / (2 (1 - theta))`` (the paper). Example: two orthogonal tokens with relevance 1 and 0.5 give
    ``diag(1, 0.25)``.
    """
    normed = unit_rows(features)
    similarity = normed @ normed.T
    q = quality.float()
    if relevance_weight is not None:
        q = torch.exp(relevance_weight / (2.0 * (1.0 - relevance_weight)) * q)
    return q[:, None] * similarity * q[None, :]


def dpp_greedy_order(kernel: torch.Tensor, steps: int, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``min(steps, n)`` picks ``[k]`` of the fast greedy MAP inference of a DPP with kernel ``[n, n]``.

    Each step takes ``argmax_j d_j^2`` (ties: the earlier token), appends its Cholesky row
    ``e = (L_j - c_j^T C) / sqrt(d_j^2)`` and lowers every gain by ``e^2`` (Chen et al., NeurIPS 2018; the
    release's loop). Spent gains (:data:`SPENT`): the rest by ``fallback`` ``[n]`` descending (default: token
    order). No host read per step.
    """
    n = kernel.shape[0]
    steps = min(int(steps), n)
    device = kernel.device
    if steps <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    kernel = kernel.float()
    gains = kernel.diagonal().clone()
    floor = gains.max().clamp_min(0) * SPENT
    order_key = (-torch.arange(n, device=device, dtype=torch.float32) if fallback is None else fallback.float())
    rows = kernel.new_zeros(steps, n)
    taken = torch.zeros(n, dtype=torch.bool, device=device)
    picks = torch.empty(steps, dtype=torch.long, device=device)
    for step in range(steps):
        best = torch.argmax(gains)
        live = gains[best] > floor
        pick = torch.where(live, best, torch.argmax(order_key.masked_fill(taken, float("-inf"))))
        prior = torch.einsum("t,tn->n", rows[:step, pick], rows[:step])
        update = (kernel[pick] - prior) / torch.sqrt(gains[pick].clamp_min(floor))
        rows[step] = torch.where(live, update, torch.zeros_like(update))
        gains = gains - torch.square(rows[step])
        taken[pick] = True
        gains = gains.masked_fill(taken, float("-inf"))
        picks[step] = pick
    return picks


def select(features: torch.Tensor, image: torch.Tensor, text: torch.Tensor, count: int, negate: bool = False,
           relevance_weight: float | None = None) -> torch.Tensor:
    """Sorted indices ``[min(count, n)]`` CDPruner keeps of one image: kernel from ``features`` ``[n, D]``,
    relevance of ``image`` ``[n, C]`` to ``text`` ``[m, C]`` (see :func:`relevance`)."""
    quality = relevance(image, text, negate)
    picks = dpp_greedy_order(conditional_kernel(features, quality, relevance_weight), count, quality)
    return torch.sort(picks).values


# -- the scorer --------------------------------------------------------------------------------------------
@register_method
@dataclass(frozen=True)
class CDPruner(Scorer):
    """Instruction-conditioned DPP (fast greedy MAP) over the LLM-input embeddings per image, pre-LLM (CDPruner)."""

    name: ClassVar[str] = "cdpruner"
    relevance_weight: float | None = None

    def __post_init__(self) -> None:
        weight = self.relevance_weight
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0.0 <= float(weight) < 1.0 or math.isnan(float(weight))):
            raise ValueError(f"relevance_weight={weight!r}: use None (the release: kernel r_i S_ij r_j) or theta in "
                             "[0, 1) (the paper: r -> exp(theta / (2 (1 - theta)) r)).")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        return (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        text, text_mask = lm_inputs.instruction_embeddings(ctx)  # before embedding_table consumes the capture
        embeddings = lm_inputs.input_embeddings(ctx)
        alive = ctx.visual & ctx.valid
        weight = None if self.relevance_weight is None else float(self.relevance_weight)

        def dpp_rank(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            """``-rank`` ``[L]`` of each slot in its image's greedy MAP order (unpicked slots last)."""
            query = text[row][text_mask[row]].float().mean(dim=0, keepdim=True)  # [1, D]: OpenVINO's mean pooling
            rank = torch.full(groups.shape, groups.numel(), dtype=torch.long, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                features = embeddings[row, slots]
                quality = relevance(features, query.to(features.device)) if bool(text_mask[row].any()) else \
                    torch.ones(slots.numel(), device=features.device)
                # a few picks beyond the quota settle the engine's rounding differences between images
                picks = dpp_greedy_order(conditional_kernel(features, quality, weight), int(quota[group]) + len(quota),
                                         quality)
                rank[slots[picks.to(slots.device)]] = torch.arange(picks.numel(), device=rank.device)
            return -rank.float()

        return lm_inputs.per_image_scores(ctx, dpp_rank)
