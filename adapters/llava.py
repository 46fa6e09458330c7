"""LLaVA-1.5 (``model_type="llava"``): CLIP tower, MLP projector, one square grid per image."""

from __future__ import annotations

import torch
from torch import nn
from vtprune.adapters.base import Adapter, VisualSegment


def band_coverage(start: float, end: float, cells: int, size: float) -> torch.Tensor:
    """Fraction ``[cells]`` of each ``size``-long cell ``[i*size, (i+1)*size)`` inside ``[start, end)``."""
    edges = torch.arange(cells + 1, dtype=torch.float64) * size
    low, high = edges[:-1].clamp(min=start), edges[1:].clamp(max=end)
    return ((high - low).clamp(min=0) / size).float()


def square_padding_fraction(height: int, width: int, side: int) -> torch.Tensor:
    """Padding fraction ``[side * side]`` (row-major) of each patch after padding an image to square.

    The image of ``height x width`` pixels is pasted at ``((M - width) // 2, (M - height) // 2)`` on an
    ``M = max(height, width)`` square (LLaVA's ``expand2square`` / ``LlavaImageProcessor.pad_to_square``),
    which is resized onto the ``side x side`` patch grid. A patch's fraction is ``1 - area inside / area``.
    """
    canvas = max(height, width)
    cell = canvas / side
    top, left = (canvas - height) // 2, (canvas - width) // 2
    rows = band_coverage(top, top + height, side, cell)
    cols = band_coverage(left, left + width, side, cell)
    return (1.0 - rows[:, None] * cols[None, :]).reshape(-1)


class LlavaAdapter(Adapter):
    """``LlavaForConditionalGeneration``: ``model.model.vision_tower`` + ``multi_modal_projector``."""

    model_types = ("llava",)
    #: CLIP / SigLIP: VFlowOpt's ViT map; "vit_attention": a vision layer's attention and keys (VisionZip).
    capabilities = Adapter.capabilities | {"clip_tower", "vit_attention"}
    family = "llava"
    image_sizes_from_user = True

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

    def padding_fraction(self, input_ids: torch.Tensor, inputs: dict) -> list[torch.Tensor] | None:
        """Per sample ``[N_b]`` padding fraction of each visual token (attention debiasing's padding mask).

        HF's LLaVA processors resize the shortest edge and centre-crop by default (``CLIPImageProcessor``;
        ``LlavaImageProcessor`` with ``do_pad=False``), which leaves no padding tokens: None. When the images
        were padded to square (``do_pad=True`` / the original ``expand2square``), the original sizes are
        needed: ``inputs["vtprune_image_sizes"]``, one ``(height, width)`` per image in batch order (set it with
        ``vtprune.methods.debias.set_image_sizes(handle, sizes)``; the LLaVA forward has no such argument).
        The padded square is assumed to fill the tower's input (resize size = crop size). CLS tokens
        (``full`` strategy) and unrecognised layouts get 0.
        """
        sizes = inputs.get("vtprune_image_sizes")
        if sizes is None:
            return None
        sizes = [tuple(int(v) for v in size) for size in sizes]
        result, image = [], 0
        for segments in self.segments(input_ids, inputs):
            parts = []
            for segment in segments:
                fraction = torch.zeros(segment.length)
                if segment.h == segment.w == self.grid_side and image < len(sizes):
                    fraction[segment.extra:] = square_padding_fraction(*sizes[image], self.grid_side)
                    image += 1
                parts.append(fraction)
            result.append(torch.cat(parts) if parts else torch.zeros(0))
        return result
