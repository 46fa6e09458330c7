"""LLaVA-1.5 (``model_type="llava"``): CLIP tower, MLP projector, one square grid per image."""

from __future__ import annotations

import torch
from torch import nn

from vtprune.adapters.base import Adapter, VisualSegment


class LlavaAdapter(Adapter):
    """``LlavaForConditionalGeneration``: ``model.model.vision_tower`` + ``multi_modal_projector``."""

    model_types = ("llava",)

    @property
    def vision_tower(self) -> nn.Module:
        return self.backbone.vision_tower

    @property
    def grid_side(self) -> int:
        vision = self.config.vision_config
        return int(vision.image_size // vision.patch_size)

    def tokens_per_image(self) -> int:
        extra = 1 if getattr(self.config, "vision_feature_select_strategy", "default") == "full" else 0
        return self.grid_side**2 + extra

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        """Every image is ``side x side`` tokens in raster order (``full`` strategy: CLS first, as extra)."""
        per_image, side = self.tokens_per_image(), self.grid_side
        result = []
        for count in self.visual_mask(input_ids).sum(dim=1).tolist():
            if count % per_image:
                result.append([VisualSegment(0, 1, 1, int(count))])
                continue
            result.append(
                [VisualSegment(i * per_image, 1, side, side, extra=per_image - side**2) for i in range(count // per_image)]
            )
        return result
