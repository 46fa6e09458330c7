"""PyramidDrop (Xing et al., CVPR 2025, arXiv:2410.17247)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import schedules
from vtprune.methods.base import Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class PyramidDrop(Scorer):
    """Progressive: last instruction token's attention at L/4, L/2, 3L/4, keeping keep^(1/3), keep^(2/3), keep."""

    name: ClassVar[str] = "pdrop"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return schedules.pyramid(num_layers, keep)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.attention("last")
