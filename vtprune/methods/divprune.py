"""DivPrune (Alvar et al., CVPR 2025, arXiv:2503.02175): keep a maximally diverse subset, before the LLM.

Max-min diversity (the paper's MMDP) by greedy farthest-point selection under the cosine distance
``d(i, j) = 1 - cos(x_i, x_j)`` of the visual embeddings entering the language model, per image (or
frame), each keeping ``keep_count(keep, n_image)``:

* first pick: the token whose nearest other token is farthest (``argmax_j min_{i != j} d(i, j)``);
* then repeatedly the token farthest from the selected set (``argmax_j min_{s in S} d(s, j)``), a
  selected token never again (ties: the earlier token).

Attention-free and text-agnostic; runs pre-LLM (stage at layer 0); Qwen3-VL (DeepStack) prunes at layer
``n`` on the embeddings that entered the LLM. Images of a batch are processed one at a time, so a sample
gets the same tokens alone or in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext


def cosine_distance(x: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` fp32 ``1 - cos`` between the rows of ``x`` ``[n, D]`` (a zero row has distance 1)."""
    normed = torch.nn.functional.normalize(x.float(), dim=-1)
    return 1.0 - normed @ normed.T


def max_min_order(distance: torch.Tensor, steps: int) -> torch.Tensor:
    """The first ``steps`` picks ``[min(steps, n)]`` of greedy max-min diversity on a distance matrix ``[n, n]``.

    Every pick stays on the device (no host read per pick): the loop runs ``steps`` times on known sizes.
    """
    n = distance.shape[0]
    steps = min(steps, n)
    if steps <= 0:
        return torch.zeros(0, dtype=torch.long, device=distance.device)
    eye = torch.eye(n, dtype=torch.bool, device=distance.device)
    nearest = distance.masked_fill(eye, float("inf")).min(dim=0).values  # distance to the nearest other token
    picks = torch.empty(steps, dtype=torch.long, device=distance.device)
    taken = torch.zeros(n, dtype=torch.bool, device=distance.device)
    pick = torch.argmax(nearest).view(1)
    closest = torch.full((n,), float("inf"), dtype=distance.dtype, device=distance.device)
    for step in range(steps):
        if step:
            pick = torch.argmax(closest).view(1)
        picks[step:step + 1] = pick
        closest = torch.minimum(closest, distance.index_select(0, pick)[0])
        taken.index_fill_(0, pick, True)
        closest = closest.masked_fill(taken, float("-inf"))
    return picks


@register_method
@dataclass(frozen=True)
class DivPrune(Scorer):
    """Max-min diversity (greedy farthest point, cosine) of the LLM-input embeddings per image, pre-LLM."""

    name: ClassVar[str] = "divprune"

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        return (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        embeddings = lm_inputs.input_embeddings(ctx)
        alive = ctx.visual & ctx.valid

        def diversity_rank(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            """``-rank`` ``[L]`` of each slot in its image's greedy max-min order (unpicked slots last)."""
            rank = torch.full(groups.shape, groups.numel(), dtype=torch.long, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                # a few picks beyond the quota settle the engine's rounding differences between images
                picks = max_min_order(cosine_distance(embeddings[row, slots]), int(quota[group]) + len(quota))
                rank[slots[picks.to(slots.device)]] = torch.arange(picks.numel(), device=rank.device)
            return -rank.float()

        return lm_inputs.per_image_scores(ctx, diversity_rank)
