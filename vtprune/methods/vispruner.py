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
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, options, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext

RELEASED_RATIO = 0.5  # --important_ratio default of the release's eval scripts
STEP = 8  # duplicates removed per round (min(8, R - need))
KEY = "vispruner"


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


def pick_priority(values: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """``[n]`` priorities in ``(0, 1)``: the picks first in pick order (``0.5 .. 0.99``), then the other tokens by
    ``values`` (higher first, ``0 .. 0.5``; ties: the earlier token). values: ``[n]``; picks: ``[k]``."""
    n = values.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    rest = torch.ones(n, dtype=torch.bool, device=values.device)
    rest[picks] = False
    ranked = torch.sort(values.float().masked_fill(~rest, float("-inf")), descending=True, stable=True).indices
    out[ranked] = 0.5 * (1.0 - (torch.arange(n, device=values.device, dtype=torch.float32) + 1) / (n + 1))
    k = picks.numel()
    out[picks] = 0.99 - 0.49 * torch.arange(k, device=values.device, dtype=torch.float32) / max(k, 1)
    return out


@register_method
@dataclass(frozen=True)
class VisPruner(Scorer):
    """Important tokens by vision-tower [CLS] attention + diverse tokens by duplicate removal, pre-LLM (VisPruner)."""

    name: ClassVar[str] = "vispruner"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Theia-4869/VisPruner",
                                                 options=(("queries", "all"),))
    important_ratio: float = RELEASED_RATIO
    vit_layer: int | None = None
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        options.number(self.important_ratio, "important_ratio", 0.0, 1.0,
                       hint=" (share of the kept tokens chosen by attention; the release: 0.5)")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        maps = tower.captures(adapter, KEY, self.vit_layer, self.name, "auto", self.queries)
        if tower.is_qwen(adapter):
            later = any(s.layer > 0 for s in stages)
            return (*maps, *((lm_inputs.lm_input_capture(adapter),) if later else ()))
        index = tower.resolve_layer(adapter, self.vit_layer, self.name)
        return (*maps, tower.feature_capture(adapter, index, KEY + "_features"))

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if tower.is_qwen(ctx.adapter):
            return self._score_images(ctx)
        table = ctx.state.get(KEY + "_table")
        if table is None or ctx.state.get(KEY + "_keep") != ctx.stage.keep:
            attention = tower.crop_records(ctx, KEY, self.name)
            features = tower.crop_records(ctx, KEY + "_features", self.name)
            quota = ctx.kept_count(attention.shape[1])
            priority = torch.stack([pick_priority(a, important_diverse(a, f, quota, self.important_ratio))
                                    for a, f in zip(attention, features, strict=True)])
            table = tower.crop_table(ctx, priority, self.name)
            ctx.state[KEY + "_table"], ctx.state[KEY + "_keep"] = table, ctx.stage.keep
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return lm_inputs.per_image_scores(ctx, lambda row, groups, quota: values[row])

    def _score_images(self, ctx: ScoreContext) -> torch.Tensor:
        """Qwen-VL: each image or frame picks from its merged tokens' attention and LLM-input embeddings."""
        attention, _ = tower.token_maps(ctx, KEY, self.name)
        attention = attention.gather(1, ctx.ordinal.clamp(min=0))
        embeddings = lm_inputs.input_embeddings(ctx)
        alive = ctx.visual & ctx.valid

        def priority(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                values = attention[row, slots]
                picks = important_diverse(values, embeddings[row, slots], int(quota[group]), self.important_ratio)
                out[slots] = pick_priority(values, picks.to(values.device)).to(out.device)
            return out

        return lm_inputs.per_image_scores(ctx, priority)


__all__ = ["VisPruner", "important_diverse", "pick_priority"]
