"""LLaVA-NeXT (``model_type="llava_next"``): anyres tiles, unpadding, image-newline tokens."""

from __future__ import annotations

import torch
from vtprune.adapters.base import VisualSegment
from vtprune.adapters.llava import LlavaAdapter, band_coverage


class LlavaNextAdapter(LlavaAdapter):
    """Each image is a base view (``side x side``) followed by the unpadded tile grid, one newline per row.

    The tile grid is reported with its newline column included in ``w`` (``extra=0``), as in VFlowOpt's
    layout, so a token's (row, col) in that segment is its place in the feature map.
    """

    model_types = ("llava_next",)
    tiled_images = True
    image_sizes_from_user = False  # the processor passes image_sizes

    def _tile_grid(self, image_size: torch.Tensor) -> tuple[int, int]:
        from transformers.models.llava_next import modeling_llava_next as modeling

        side = self.grid_side
        rows, cols = modeling.get_anyres_image_grid_shape(
            image_size.tolist(), self.config.image_grid_pinpoints, self.config.vision_config.image_size
        )
        unpadded = modeling.unpad_image(torch.zeros(1, rows * side, cols * side), image_size)
        return int(unpadded.shape[1]), int(unpadded.shape[2])

    def _grids_from_features(self, inputs: dict) -> list[tuple[int, int]] | None:
        """Tile grids ``(h, w)`` of pre-encoded images: ``generate`` passes packed features, not sizes.

        Each packed image is the base view followed by ``h`` rows of ``w`` tiles and one newline token.
        """
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        newline = getattr(self.backbone, "image_newline", None)
        if encoded is None or newline is None or getattr(encoded, "pooler_output", None) is None:
            return None
        grids, base = [], self.grid_side**2
        for features in encoded.pooler_output:
            marks = (features[base:] == newline.to(features.dtype)).all(dim=-1)
            rows = int(marks.sum())
            if rows == 0 or (features.shape[0] - base) % rows:
                return None
            grids.append((rows, (features.shape[0] - base) // rows - 1))
        return grids

    def segments(self, input_ids: torch.Tensor, inputs: dict) -> list[list[VisualSegment]]:
        image_sizes = inputs.get("image_sizes")
        counts = self.visual_mask(input_ids).sum(dim=1).tolist()
        grids = [self._tile_grid(size) for size in image_sizes] if image_sizes is not None else (
            self._grids_from_features(inputs))
        if grids is None:
            return [[VisualSegment(0, 1, 1, int(n))] if n else [] for n in counts]
        side, image, result = self.grid_side, 0, []
        for count in counts:
            segments, start = [], 0
            while start < count and image < len(grids):
                height, width = grids[image]
                segments.append(VisualSegment(start, 1, side, side))
                segments.append(VisualSegment(start + side * side, 1, height, width + 1, kind="tiles"))
                start += side * side + height * (width + 1)
                image += 1
            if start != count:
                segments = [VisualSegment(0, 1, 1, int(count))]
            result.append(segments)
        return result

    def _tile_padding(self, image_size: torch.Tensor) -> torch.Tensor:
        """Padding fraction ``[h * (w + 1)]`` of the unpadded tile grid of one image (newline column: 0).

        Mirrors the processor: the image is resized to fit the best pinpoint resolution (aspect kept,
        ``get_patch_output_size``) and pasted centred (``(target - new) // 2``); ``unpad_image`` then crops whole
        padded feature rows / columns, so only a partial row or column can remain.
        """
        import math

        from transformers.image_processing_utils import select_best_resolution
        from transformers.models.llava_next import modeling_llava_next as modeling

        height, width = (int(v) for v in image_size.tolist())
        target_h, target_w = select_best_resolution((height, width), self.config.image_grid_pinpoints)
        scale_w, scale_h = target_w / width, target_h / height
        if scale_w < scale_h:
            new_w, new_h = target_w, min(math.ceil(height * scale_w), target_h)
        else:
            new_h, new_w = target_h, min(math.ceil(width * scale_h), target_w)
        top, left = (target_h - new_h) // 2, (target_w - new_w) // 2
        rows, cols = modeling.get_anyres_image_grid_shape([height, width], self.config.image_grid_pinpoints,
                                                          self.config.vision_config.image_size)
        side = self.grid_side
        cell = self.config.vision_config.image_size / side
        inside_rows = band_coverage(top, top + new_h, rows * side, cell)
        inside_cols = band_coverage(left, left + new_w, cols * side, cell)
        fraction = 1.0 - inside_rows[:, None] * inside_cols[None, :]
        fraction = modeling.unpad_image(fraction[None], [height, width])[0]
        return torch.cat([fraction, torch.zeros(fraction.shape[0], 1)], dim=1).reshape(-1)

    def padding_fraction(self, input_ids: torch.Tensor, inputs: dict) -> list[torch.Tensor] | None:
        """Per sample ``[N_b]`` padding fraction of each visual token, from the processor's ``image_sizes``.

        The base view is resized (squashed), never padded: 0. Tiles are letter-boxed but ``unpad_image``
        crops the padded feature rows / columns, so at most a partial row / column keeps a fraction > 0:
        the mask is nearly a no-op. Layouts the adapter cannot resolve (e.g. OneVision's downsized tiles)
        get 0. None without ``image_sizes``.
        """
        sizes = inputs.get("image_sizes")
        if sizes is None:
            return None
        result, image = [], 0
        for segments in self.segments(input_ids, inputs):
            parts = []
            for segment in segments:
                fraction = torch.zeros(segment.length)
                if segment.kind == "tiles" and image < len(sizes):
                    tiles = self._tile_padding(torch.as_tensor(sizes[image]))
                    if tiles.numel() == segment.length:
                        fraction = tiles
                    image += 1
                parts.append(fraction)
            result.append(torch.cat(parts) if parts else torch.zeros(0))
        return result
