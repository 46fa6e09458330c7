"""LLaVA-OneVision (``model_type="llava_onevision"``): SigLIP tower, anyres-max tiles, video frames."""

from __future__ import annotations

import torch
from vtprune.adapters.base import VisualSegment
from vtprune.adapters.llava_next import LlavaNextAdapter


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """Like LLaVA-NeXT; tiles may be bilinearly downsized, in which case the sample is one flat segment."""

    model_types = ("llava_onevision",)

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        if inputs.get("pixel_values_videos") is not None:
            counts = self.visual_mask(input_ids).sum(dim=1).tolist()
            return [[VisualSegment(0, 1, 1, int(n), kind="video")] if n else [] for n in counts]
        return super().segments(input_ids, inputs)
