"""VisPruner (Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning in
VLMs", ICCV 2025, arXiv:2412.01818): important tokens by the vision encoder's attention, then diverse tokens by
iterative duplicate removal, before the language model.

Of the ``T`` tokens a crop keeps (:func:`important_diverse`):

1. **Important** tokens: the top ``int(T * important_ratio)`` by the attention they receive at the projector's
   feature layer (default ratio 0.5, the release's ``--important_ratio``; its scripts also run 0.75).
2. **Diverse** tokens fill the rest: the remaining tokens, in descending attention order, are split into
   alternate halves ``a`` (even positions) and ``b`` (odd); the ``r = min(8, R - need)`` tokens of ``a`` whose
   best cosine similarity to ``b`` is highest are dropped and the list becomes ``a`` (kept, by descending
   similarity) then ``b``; repeated until ``need`` tokens are left (the release's ``encode_images``).

Families (the release runs LLaVA-1.5 and LLaVA-NeXT):

* **CLIP** (LLaVA-1.5 / NeXT): the [CLS] query's row of the feature layer's head-mean attention, the CLS column
  dropped (``image_attentions[:, :, 0, 1:]``), and the feature layer's output (before the projector) for the
  similarity, as the release. **Per crop** as the release: every crop keeps its own ``T = keep x patches``
  (LLaVA-NeXT: the base view and each tile, before unpadding); the crops' picks are laid out as the model packs
  them, newline tokens first. An image then keeps vtprune's count ``keep x N0`` (the release keeps each crop's
  picks that survive unpadding, plus every newline): picks come first, ranked by their position in their crop's
  pick order, then the rest by attention.
* **SigLIP** (LLaVA-OneVision; no [CLS]): the attention received from all queries (mean), per crop, as above.
* **Qwen2/2.5/3-VL** (no [CLS]; AngelSlim's ``vispruner`` rule for Qwen2.5-VL): the attention a merged token
  receives from all queries of the last full-attention ViT block (:mod:`vtprune.methods.tower`), and the
  LLM-input embeddings for the similarity, per image or frame, each keeping ``keep_count(keep, n)``. Qwen3-VL
  (DeepStack) prunes at layer ``n`` on the same maps.

Text-agnostic (the instruction plays no part). The release's ``argsort`` is not stable; vtprune's sorts are
(ties: the earlier token). With an odd number of remaining tokens the release's indexing fails; vtprune keeps
all of ``a``'s survivors (the same rule). ``vit_layer`` picks another layer; ``queries`` as VisionZip's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vtprune.methods import options
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.tower_picks import TowerPicker, pick_priority

RELEASED_RATIO = 0.5  # --important_ratio default of the release's eval scripts
STEP = 8  # duplicates removed per round (min(8, R - need))


# -- pure functions ----------------------------------------------------------------------------------------
def important_diverse(attention: torch.Tensor, features: torch.Tensor, count: int,
                      important_ratio: float = RELEASED_RATIO, step: int = STEP) -> torch.Tensor:
    """The ``min(count, n)`` tokens VisPruner keeps of one crop ``[k]``: important ones first (by attention), then
    the diverse ones in the order the last round leaves them.

    attention: ``[n]`` received attention (higher is more important); features: ``[n, D]`` the tokens' features
    (cosine similarity). ``int(count * important_ratio)`` important tokens; the rest by iterative duplicate
    removal, at most ``step`` per round (see the module docstring).
    """
    n = attention.shape[0]
    count = min(int(count), n)
    n_important = int(count * important_ratio)
    need = count - n_important
    order = torch.sort(attention.float(), descending=True, stable=True).indices
    important, residual = order[:n_important], order[n_important:]
    if need <= 0:
        return important
    normed = features.float()[residual]
    normed = normed / normed.norm(dim=-1, keepdim=True)
    similarity = normed @ normed.T  # once [R, R]: each round reads its a x b block (R^2 D, not R^3 D / 48)
    local = torch.arange(residual.numel(), device=residual.device)
    while True:
        drop = min(step, local.numel() - need)
        if drop <= 0:
            break
        a, b = local[0::2], local[1::2]
        best = similarity[a][:, b].max(dim=-1).values
        survivors = torch.sort(best, descending=True, stable=True).indices[drop:]
        local = torch.cat([a[survivors], b])
    return torch.cat([important, residual[local]])


@register_method
@dataclass(frozen=True)
class VisPruner(TowerPicker):
    """Important tokens by vision-tower [CLS] attention + diverse tokens by duplicate removal, pre-LLM (VisPruner)."""

    name: ClassVar[str] = "vispruner"
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Theia-4869/VisPruner",
                                                 options=(("queries", "all"),))
    important_ratio: float = RELEASED_RATIO
    vit_layer: int | None = None
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        options.number(self.important_ratio, "important_ratio", 0.0, 1.0,
                       hint=" (share of the kept tokens chosen by attention; the release: 0.5)")

    def pick(self, attention: torch.Tensor, features: torch.Tensor, quota: int) -> torch.Tensor:
        return important_diverse(attention, features, quota, self.important_ratio)


__all__ = ["VisPruner", "important_diverse", "pick_priority"]
