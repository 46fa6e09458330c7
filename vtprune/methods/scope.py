"""SCOPE (Deng et al., "SCOPE: Saliency-Coverage Oriented Token Pruning for Efficient Multimodel LLMs", NeurIPS
2025, arXiv:2510.24214; release kinredon/SCOPE, also shipped by Tencent/AngelSlim's token_compressor): the tokens
that add the most attention-weighted coverage of the image's tokens, before the language model.

Of the ``T`` tokens a crop keeps, greedily (:func:`saliency_coverage_order`, the release's ``SCOPE``): with
``s_ij`` the cosine similarity of tokens ``i`` and ``j`` and ``c_i`` how well the kept set covers token ``i``
(``max`` of ``s_ij`` over the kept ``j``; 0 before the first pick), each step keeps the unkept token ``j`` with
the largest SCOPE score ``sum_i max(s_ij - c_i, 0) * a_j ** alpha`` (``a_j``: the saliency, the attention the token
receives in the vision encoder; ties: the earlier token). Release defaults: ``alpha = 1.0`` (``ALPHA``), the
product of coverage gain and saliency (``COMBINED=multi``).

Families (the release runs LLaVA-1.5 and LLaVA-NeXT):

* **CLIP** (LLaVA-1.5 / NeXT): the [CLS] row of the feature layer's attention (``attentions[-2]``, CLS column
  dropped; the release sums the heads, vtprune averages them: the same picks, up to rounding) and the feature
  layer's output before the projector for the similarity (``hidden_states[-2]``), as the authors' release. **Per
  crop**: every crop keeps its own ``T = keep x patches`` (the release divides its count over the crops of
  LLaVA-NeXT), laid out as the model packs them (:func:`vtprune.methods.tower.crop_table`); an image keeps
  vtprune's ``keep x N0``: picks first, in pick order, then the rest by attention.
* **SigLIP** (LLaVA-OneVision; no [CLS]): the attention received from all queries (mean), per crop, as above.
* **Qwen2/2.5/3-VL** (no [CLS]; AngelSlim's ``scope`` rule for Qwen2.5-VL): the attention a merged token
  receives from all queries of the last full-attention ViT block (AngelSlim: ``layer_idx=-1``, the sum over a
  2x2 unit) and the LLM-input embeddings for the similarity, per image or video frame, each keeping
  ``keep_count(keep, n)``. Qwen3-VL (DeepStack) prunes at layer ``n`` on the same maps.

``features="lm"`` takes AngelSlim's LLaVA rule: the similarity of the LLM-input embeddings (after the projector),
per image (base view and tiles apart) instead of per crop. Where vtprune differs from AngelSlim: AngelSlim
selects over every visual token of a sample at once (one budget for all its images); vtprune gives each image (or
frame) its own share, as the authors' release does per image. Text-agnostic. ``vit_layer`` picks another layer;
``queries`` as VisionZip's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.methods import options, tower
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.tower_picks import TowerPicker

RELEASED_ALPHA = 1.0  # ALPHA=1.0 in the release's run scripts; AngelSlim's configs: alpha 1.0
FEATURES = ("auto", "lm")


# -- pure functions ----------------------------------------------------------------------------------------
def saliency_coverage_order(saliency: torch.Tensor, features: torch.Tensor, count: int,
                            alpha: float = RELEASED_ALPHA) -> torch.Tensor:
    """The first ``min(count, n)`` picks ``[k]`` of SCOPE's greedy selection of one crop, in pick order.

    saliency: ``[n]`` attention received (``>= 0``); features: ``[n, D]`` the tokens' features (cosine similarity).
    Each step: the unpicked ``j`` maximising ``sum_i max(s_ij - c_i, 0) * saliency_j ** alpha`` (``c``: the
    coverage so far, starting at 0); ties: the earlier token.
    """
    n = saliency.shape[0]
    count = min(int(count), n)
    unit = features.float()
    unit = unit / unit.norm(dim=-1, keepdim=True)
    similarity = unit @ unit.T  # [n, n]: s_ij
    weight = saliency.float() ** alpha
    covered = torch.zeros(n, dtype=torch.float32, device=saliency.device)
    taken = torch.zeros(n, dtype=torch.bool, device=saliency.device)
    picks = torch.empty(count, dtype=torch.long, device=saliency.device)
    excess = torch.empty_like(similarity)  # reused each step: max(s_ij - c_i, 0)
    for step in range(count):
        torch.sub(similarity, covered[:, None], out=excess)
        gain = excess.clamp_(min=0).sum(dim=0) * weight
        pick = torch.argmax(gain.masked_fill(taken, float("-inf")))
        picks[step] = pick
        taken[pick] = True
        covered = torch.maximum(covered, similarity[pick])
    return picks


@register_method
@dataclass(frozen=True)
class Scope(TowerPicker):
    """Saliency-weighted coverage gain (greedy), per crop or image, pre-LLM (SCOPE)."""

    name: ClassVar[str] = "scope"
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="kinredon/SCOPE",
                                                 options=(("queries", "all"),))
    extra_picks: ClassVar[bool] = True  # a few picks beyond an image's quota settle rounding between images
    alpha: float = RELEASED_ALPHA
    features: str = "auto"
    vit_layer: int | None = None
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        options.number(self.alpha, "alpha", 0.0,
                       hint=" (the saliency's exponent in the SCOPE score; the release: 1.0)")
        if self.features not in FEATURES:
            raise ValueError(f"features={self.features!r}: use 'auto' (the feature layer's output on LLaVA towers, as "
                             "the authors' release) or 'lm' (the LLM-input embeddings, AngelSlim's rule).")

    def per_image(self, adapter: Any) -> bool:
        """Whether selection runs per image on LLM-input embeddings (Qwen-VL, ``features="lm"``), not per crop."""
        return tower.is_qwen(adapter) or self.features == "lm"

    def pick(self, attention: torch.Tensor, features: torch.Tensor, quota: int) -> torch.Tensor:
        return saliency_coverage_order(attention, features, quota, self.alpha)


__all__ = ["Scope", "saliency_coverage_order"]
