"""HiPrune (Liu et al., "HiPrune: Training-Free Visual Token Pruning via Hierarchical Attention in Vision-Language
Models", arXiv:2508.00553; release Danielement321/HiPrune): anchor, buffer and register tokens from two layers of
the vision encoder, before the language model.

Of the ``T`` tokens a crop (or a Qwen-VL image / frame) keeps (:func:`hierarchical_select`):

1. **Anchor** tokens: the top ``round(T * alpha / 5)`` (Python's half-to-even ``round``, as released; default
   ``alpha = 0.1``) by the attention received at a middle, object-centric layer ``object_layer``.
2. **Buffer** tokens: each anchor's four neighbours in the flat token grid (``i - 1``, ``i + 1``, ``i - w``,
   ``i + w``, clamped to ``0 .. n - 1`` as released: a row's first and last tokens are neighbours across the
   row break), together with the anchors (duplicates once).
3. **Register** tokens fill the rest: the top of the attention received at a deep layer (the projector's feature
   layer; Qwen-VL: the last block), among the tokens not yet kept.

The attention a token receives is the mean over all queries and heads ("global attention", CLS column dropped),
as released for CLIP and Qwen2.5-VL (sum over queries, mean over each 2x2 merge group: the same ranking).

Defaults: ``object_layer`` None is the release's layer scaled to the tower: 0-based 8 (its
``HIPRUNE_OBJECT_LAYER=9``) of 24 on CLIP / SigLIP, 15 (``=16``) of 32 on Qwen-VL, moved to the nearest
full-attention block on Qwen2.5-VL; ``vit_layer`` None is the feature layer (CLIP / SigLIP) or the last
full-attention block (Qwen-VL), as released. CLIP / SigLIP towers select **per crop** (LLaVA-NeXT: the base view
and each tile, as the release's ``int(N' / crops)`` per crop), laid out as the model packs them, newline tokens
first; an image keeps vtprune's ``keep x N0``, picks first (by place in their crop's order), then the rest by
deep attention. Qwen2/2.5/3-VL select per image or video frame on merged tokens (grid width ``w`` of the merged
grid); Qwen3-VL (DeepStack) prunes at layer ``n`` on the same maps.

Where vtprune differs from the release: on Qwen2.5-VL the release subtracts 1 from the *summed* deep attention of
anchor and buffer tokens, so one whose sum exceeds 1 can be picked again as a register and the image keeps fewer
than ``T``; vtprune picks registers among the other tokens (the paper's rule; on CLIP, whose mean attention is
below 1, the two agree). When the anchors' crosses exceed ``T`` (only at tiny budgets, where the release's
``topk`` fails), the crosses keep their top ``T`` by object-layer attention. Sorts are stable (ties: the earlier
token). Text-agnostic. ``queries`` as VisionZip's (Qwen-VL towers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, options, tower, vit
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.tower_picks import pick_priority
from vtprune.scoring import ScoreContext

RELEASED_ALPHA = 0.1
CLIP_OBJECT = (9, 24)  # the release's 1-based object layer of a 24-layer CLIP tower (LLaVA-1.5 / NeXT)
QWEN_OBJECT = (16, 32)  # ... of Qwen2.5-VL's 32 blocks
SHALLOW, DEEP = "hiprune_object", "hiprune_deep"


# -- pure functions ----------------------------------------------------------------------------------------
def anchor_count(count: int, alpha: float) -> int:
    """Anchors of a crop keeping ``count`` tokens: ``round(count * alpha / 5)``, Python's half-to-even ``round``."""
    return round(count * alpha / 5)


def hierarchical_select(shallow: torch.Tensor, deep: torch.Tensor, count: int, width: int,
                        alpha: float = RELEASED_ALPHA) -> torch.Tensor:
    """The ``min(count, n)`` tokens HiPrune keeps of one crop ``[k]``: anchors with their buffers (ascending), then
    registers (by deep attention).

    shallow, deep: ``[n]`` attention received at the object and the deep layer; width: the row length ``w`` of the
    flat ``h x w`` token grid (neighbours ``i +- 1``, ``i +- w``, clamped to ``0 .. n - 1``).
    """
    n = shallow.shape[0]
    count = min(int(count), n)
    anchors = anchor_count(count, alpha)
    cross = torch.zeros(0, dtype=torch.long, device=shallow.device)
    if anchors > 0:
        top = torch.sort(shallow.float(), descending=True, stable=True).indices[:anchors]
        cross = torch.cat([top, top - 1, top + 1, top - width, top + width]).clamp(0, n - 1).unique()
        if cross.numel() > count:
            best = torch.sort(shallow.float()[cross], descending=True, stable=True).indices[:count]
            cross = cross[best].sort().values
    free = torch.ones(n, dtype=torch.bool, device=shallow.device)
    free[cross] = False
    ranked = torch.sort(deep.float().masked_fill(~free, float("-inf")), descending=True, stable=True).indices
    return torch.cat([cross, ranked[: count - cross.numel()]])


def group_widths(segments: list) -> list[int]:
    """Row length ``w`` of each group (image, or frame of a video) of one sample, in the order of
    :func:`vtprune.methods.per_frame.frame_ids`: a segment with ``t > 1`` frames gives ``t`` groups."""
    return [int(s.w) for s in segments for _ in range(int(s.t) if s.t > 1 else 1)]


def scaled_object_layer(depth: int, full: list[int] | None = None, released: tuple[int, int] = CLIP_OBJECT) -> int:
    """0-based object layer of a ``depth``-layer tower: the release's ``released = (layer, of)`` scaled
    (``round(depth * layer / of) - 1``, at least 0), moved to the nearest of ``full`` blocks when given (ties: the
    earlier)."""
    index = max(round(depth * released[0] / released[1]) - 1, 0)
    if full:
        index = min(full, key=lambda block: (abs(block - index), block))
    return index


@register_method
@dataclass(frozen=True)
class HiPrune(Scorer):
    """Anchor + buffer tokens from a middle ViT layer, register tokens from a deep one, pre-LLM (HiPrune)."""

    name: ClassVar[str] = "hiprune"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Danielement321/HiPrune",
                                                 options=(("queries", "all"),))
    alpha: float = RELEASED_ALPHA
    object_layer: int | None = None
    vit_layer: int | None = None
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        options.number(self.alpha, "alpha", 0.0, 1.0,
                       hint=" (share of the kept tokens spent on anchors and their buffers; the release: 0.1)")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def layer(self, adapter: Any) -> int:
        """The object layer (0-based) of ``adapter``'s tower: the option, else the release's scaled."""
        if self.object_layer is not None:
            return self.object_layer
        if tower.is_qwen(adapter):
            return scaled_object_layer(tower.vit_depth(adapter), adapter.vit_full_attention_blocks(), QWEN_OBJECT)
        return scaled_object_layer(tower.vit_depth(adapter))

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        if not tower.is_qwen(adapter) and vit.keeps_cls(adapter):
            raise ValueError("hiprune's buffer tokens need the patch grid, but this LLaVA keeps the CLS token "
                             "(vision_feature_select_strategy='full'); use a 'default'-strategy model or 'vispruner'.")
        tower.resolve_layer(adapter, self.layer(adapter), self.name, "object_layer")
        shallow = tower.captures(adapter, SHALLOW, self.layer(adapter), self.name, "mean", self.queries)
        deep = tower.captures(adapter, DEEP, self.vit_layer, self.name, "mean", self.queries)
        later = tower.is_qwen(adapter) and any(s.layer > 0 for s in stages)
        return (*shallow, *deep, *((lm_inputs.lm_input_capture(adapter),) if later else ()))

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if tower.is_qwen(ctx.adapter):
            return self._score_images(ctx)
        table = ctx.state.get("hiprune_table")
        if table is None or ctx.state.get("hiprune_keep") != ctx.stage.keep:
            shallow = tower.crop_records(ctx, SHALLOW, self.name)
            deep = tower.crop_records(ctx, DEEP, self.name)
            config = ctx.adapter.config.vision_config
            width = int(config.image_size) // int(config.patch_size)
            quota = ctx.kept_count(shallow.shape[1])
            priority = torch.stack([pick_priority(d, hierarchical_select(s, d, quota, width, self.alpha))
                                    for s, d in zip(shallow, deep, strict=True)])
            table = tower.crop_table(ctx, priority, self.name)
            ctx.state["hiprune_table"], ctx.state["hiprune_keep"] = table, ctx.stage.keep
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return lm_inputs.per_image_scores(ctx, lambda row, groups, quota: values[row])

    def _score_images(self, ctx: ScoreContext) -> torch.Tensor:
        """Qwen-VL: each image or frame selects on its merged-token grid."""
        shallow = tower.token_maps(ctx, SHALLOW, self.name)[0].gather(1, ctx.ordinal.clamp(min=0))
        deep = tower.token_maps(ctx, DEEP, self.name)[0].gather(1, ctx.ordinal.clamp(min=0))
        alive = ctx.visual & ctx.valid

        def priority(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            widths = group_widths(ctx.segments[row])
            out = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                width = int(widths[group]) if group < len(widths) else slots.numel()
                picks = hierarchical_select(shallow[row, slots], deep[row, slots], int(quota[group]), width, self.alpha)
                out[slots] = pick_priority(deep[row, slots], picks.to(slots.device)).to(out.device)
            return out

        return lm_inputs.per_image_scores(ctx, priority)
