"""FastV (Chen et al., ECCV 2024, arXiv:2403.06764).

Release (pkunlp-icler/FastV, ``parity="release"``): an absolute kept count ``R`` (``fast_v_attention_rank``;
``keep = R / N0`` keeps exactly ``R``) and original position ids (``position_ids = keep_indexs``), so only the
debiasing patch differs from vtprune's defaults (:data:`vtprune.methods.debias.FASTV_RELEASE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.methods.base import Scorer
from vtprune.methods.debias import FASTV_RELEASE
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class FastV(Scorer):
    """Last prompt token's attention at layer K-1, prune before layer K (default K=2)."""

    name: ClassVar[str] = "fastv"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})
    score_offset: ClassVar[int] = 1
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", debias=FASTV_RELEASE,
                                                 source="pkunlp-icler/FastV, fast_v_attention_rank R")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.attention("last")
