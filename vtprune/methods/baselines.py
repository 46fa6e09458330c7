"""Reference methods: ``none`` (every token kept, through the same hooks), ``random`` and ``oracle``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, options
from vtprune.methods.base import Scorer
from vtprune.methods.per_frame import frame_ids
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class NoPruning(Scorer):
    """Keep every token (the unpruned reference through the same hooks)."""

    name: ClassVar[str] = "none"

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return ()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return torch.zeros(ctx.valid.shape, device=ctx.valid.device)


def random_values(count: int, seed: int = 0, layer: int = 0) -> torch.Tensor:
    """``[count]`` fp32 seeded uniform values, one per visual ordinal (``random`` keeps the highest; the vLLM
    plugin uses the same values per image)."""
    return torch.rand(count, generator=torch.Generator().manual_seed(seed * 1000 + layer))


@register_method
@dataclass(frozen=True)
class RandomPruning(Scorer):
    """Seeded random subset (baseline); a sample gets the same subset alone or in a batch."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        options.integer(self.seed, "seed")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.rounding == "per_image":  # each image / frame its own values and share, as the vLLM plugin draws them
            return lm_inputs.per_image_scores(ctx, lambda row, groups, quota: self._group_values(ctx, row))
        table = random_values(max(ctx.visual_counts, default=0) + 1, self.seed, ctx.stage.layer).to(ctx.valid.device)
        return torch.where(ctx.ordinal >= 0, table[ctx.ordinal.clamp(min=0)], torch.zeros_like(table[:1]))

    def _group_values(self, ctx: ScoreContext, row: int) -> torch.Tensor:
        """``[L]`` values of sample ``row``: a visual slot's value in ``random_values(n_g)`` of its image / frame
        ``g`` (``n_g`` original tokens), indexed by its place in that group; 0 off the visual tokens."""
        total = ctx.visual_counts[row]
        ids = frame_ids(ctx.segments[row], total)
        sizes = torch.bincount(ids, minlength=int(ids.max()) + 1 if total else 0)
        starts = torch.cumsum(sizes, 0) - sizes  # groups are contiguous runs of ordinals
        table = torch.zeros(total + 1)
        for start, size in zip(starts.tolist(), sizes.tolist(), strict=True):
            table[start:start + size] = random_values(size, self.seed, ctx.stage.layer)
        ordinal = ctx.ordinal[row]
        values = table.to(ordinal.device)[ordinal.clamp(min=0)]
        return torch.where(ordinal >= 0, values, torch.zeros_like(values))


@register_method
@dataclass(frozen=True)
class Oracle(Scorer):
    """Evidence tokens first (benchmark upper reference; ``handle.set_evidence`` gives each sample's weights)."""

    name: ClassVar[str] = "oracle"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        evidence = ctx.inputs.get("vtprune_evidence")
        if evidence is None:
            raise ValueError("method 'oracle' needs the evidence of each sample: call handle.set_evidence([...]).")
        scores = torch.zeros(ctx.valid.shape, device=ctx.valid.device)
        for row, values in enumerate(evidence):
            values = torch.as_tensor(values, dtype=torch.float32, device=scores.device)
            alive = ctx.ordinal[row] >= 0
            # Evidence first; among equals, earlier tokens win through the selection's tie rule.
            scores[row, alive] = values[ctx.ordinal[row, alive]]
        return scores
