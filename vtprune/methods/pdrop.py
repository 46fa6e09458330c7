"""PyramidDrop (Xing et al., CVPR 2025, arXiv:2410.17247).

Release (Cooperx521/PyramidDrop ``modeling_llama_pdrop.py``, ``parity="release"``): ``int(N0 * ratio_s)`` tokens
per stage (truncation; vtprune rounds half up) and position ids compacted to ``0..L'-1`` after each drop
(decode ids shifted by the tokens dropped); the debiasing patch debiases stage 0 only
(:data:`vtprune.methods.debias.PDROP_RELEASE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import schedules
from vtprune.methods.base import Scorer
from vtprune.methods.debias import PDROP_RELEASE
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class PyramidDrop(Scorer):
    """Progressive: last instruction token's attention at L/4, L/2, 3L/4, keeping keep^(1/3), keep^(2/3), keep."""

    name: ClassVar[str] = "pdrop"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="truncate", positions="compact", debias=PDROP_RELEASE,
                                                 source="Cooperx521/PyramidDrop")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return schedules.pyramid(num_layers, keep)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return ctx.attention("last")
