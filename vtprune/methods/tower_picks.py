"""The shared part of the methods that pick tokens one by one from a vision-tower attention map and token features
(VisPruner, SCOPE): where the inputs come from, per crop or per image, and how an ordered pick list becomes scores.

A subclass sets ``name`` and implements :meth:`TowerPicker.pick` (a pure function of one crop's or image's
attention ``[n]`` and features ``[n, D]``); this base registers the tower captures, and scores

* LLaVA families (CLIP / SigLIP towers): per crop, on the feature layer's output features, once per call and keep
  (:func:`vtprune.methods.tower.crop_table` maps the crops' priorities onto the visual slots);
* Qwen-VL (or :meth:`TowerPicker.per_image`): per image or video frame, on the LLM-input embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.scoring import ScoreContext


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


@dataclass(frozen=True)
class TowerPicker(Scorer):
    """Base of the tower-attention pickers (no method of its own). Subclasses have ``vit_layer`` and ``queries``."""

    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    #: picks beyond an image's quota (Qwen-VL path), which settle the engine's rounding between images
    extra_picks: ClassVar[bool] = False

    def pick(self, attention: torch.Tensor, features: torch.Tensor, quota: int) -> torch.Tensor:
        """The picked token indices ``[<= quota]`` in pick order, from attention ``[n]`` and features ``[n, D]``."""
        raise NotImplementedError

    def per_image(self, adapter: Any) -> bool:
        """Whether selection runs per image on LLM-input embeddings (Qwen-VL), not per crop on tower features."""
        return tower.is_qwen(adapter)

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        maps = tower.captures(adapter, self.name, self.vit_layer, self.name, "auto", self.queries)
        if self.per_image(adapter):
            later = any(s.layer > 0 for s in stages)
            return (*maps, *((lm_inputs.lm_input_capture(adapter),) if later else ()))
        index = tower.resolve_layer(adapter, self.vit_layer, self.name)
        return (*maps, tower.feature_capture(adapter, index, self.name + "_features"))

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if self.per_image(ctx.adapter):
            return self._score_images(ctx)
        key = self.name
        table = ctx.state.get(key + "_table")
        if table is None or ctx.state.get(key + "_keep") != ctx.stage.keep:
            attention = tower.crop_records(ctx, key, self.name)
            features = tower.crop_records(ctx, key + "_features", self.name)
            quota = ctx.kept_count(attention.shape[1])
            priority = torch.stack([pick_priority(a, self.pick(a, f, quota))
                                    for a, f in zip(attention, features, strict=True)])
            table = tower.crop_table(ctx, priority, self.name)
            ctx.state[key + "_table"], ctx.state[key + "_keep"] = table, ctx.stage.keep
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return lm_inputs.per_image_scores(ctx, lambda row, groups, quota: values[row])

    def _score_images(self, ctx: ScoreContext) -> torch.Tensor:
        """Each image or frame picks from its tokens' attention and LLM-input embeddings."""
        attention, _ = tower.token_maps(ctx, self.name, self.name)
        attention = attention.gather(1, ctx.ordinal.clamp(min=0))
        embeddings = lm_inputs.input_embeddings(ctx)
        alive = ctx.visual & ctx.valid

        def priority(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
            extra = len(quota) if self.extra_picks else 0
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                values = attention[row, slots]
                picks = self.pick(values, embeddings[row, slots].to(values.device), int(quota[group]) + extra)
                out[slots] = pick_priority(values, picks.to(values.device)).to(out.device)
            return out

        return lm_inputs.per_image_scores(ctx, priority)
