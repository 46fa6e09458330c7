"""FastV (Chen et al., ECCV 2024, arXiv:2403.06764)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.methods.base import Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class FastV(Scorer):
    """Last prompt token's attention at layer K-1, prune before layer K (default K=2)."""

    name: ClassVar[str] = "fastv"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})
    score_offset: ClassVar[int] = 1

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.attention("last")
