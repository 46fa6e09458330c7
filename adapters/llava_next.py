"""LLaVA-NeXT (``model_type="llava_next"``): anyres tiles, unpadding, image-newline tokens."""

from __future__ import annotations

import torch

from vtprune.adapters.base import VisualSegment
from vtprune.adapters.llava import LlavaAdapter


class LlavaNextAdapter(LlavaAdapter):
    """Each image is a base view (``side x side``) followed by the unpadded tile grid, one newline per row.

    The tile grid is reported with its newline column included in ``w`` (``extra=0``), as in VFlowOpt's
    layout, so a token's (row, col) in that segment is its place in the feature map.
    """

    model_types = ("llava_next",)

    def _tile_grid(self, image_size: torch.Tensor) -> tuple[int, int]:
        from transformers.models.llava_next import modeling_llava_next as modeling

        side = self.grid_side
        rows, cols = modeling.get_anyres_image_grid_shape(
            image_size.tolist(), self.config.image_grid_pinpoints, self.config.vision_config.image_size
        )
        unpadded = modeling.unpad_image(torch.zeros(1, rows * side, cols * side), image_size)
        return int(unpadded.shape[1]), int(unpadded.shape[2])

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        image_sizes = inputs.get("image_sizes")
        counts = self.visual_mask(input_ids).sum(dim=1).tolist()
        if image_sizes is None:
            return [[VisualSegment(0, 1, 1, int(n))] if n else [] for n in counts]
        side, image, result = self.grid_side, 0, []
        for count in counts:
            segments, start = [], 0
            while start < count and image < len(image_sizes):
                height, width = self._tile_grid(image_sizes[image])
                segments.append(VisualSegment(start, 1, side, side))
                segments.append(VisualSegment(start + side * side, 1, height, width + 1, kind="tiles"))
                start += side * side + height * (width + 1)
                image += 1
            if start != count:
                segments = [VisualSegment(0, 1, 1, int(count))]
            result.append(segments)
        return result
