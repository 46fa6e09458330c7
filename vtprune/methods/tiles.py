"""Anyres tile layouts of LLaVA-NeXT / LLaVA-OneVision images, and per-crop maps arranged like the features.

The model packs each image as the ``side x side`` base view followed by its tile grid: ``rows x cols``
crops of ``side x side`` features, centre-cropped by ``unpad_image`` to ``H x W``, bilinearly downsized
by OneVision to ``h x w`` when larger than ``anyres_max_N`` allows, plus one newline column.

The layout comes from the processor's ``image_sizes`` when the call has them (a plain forward). Under
``generate`` (transformers >= 5.2x encodes images *before* the prefill and drops ``image_sizes``), it is
recovered from the pre-encoded features: the newline positions give ``h x w`` exactly, and the pinpoint
grid plus the crop are the ones that reproduce it (the vision-tower batch size disambiguates).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TileLayout:
    """One image: ``crops`` vision-tower crops; ``rows x cols`` tiles unpadded to ``unpadded``, packed as ``final``."""

    crops: int
    rows: int = 0
    cols: int = 0
    unpadded: tuple[int, int] = (0, 0)
    final: tuple[int, int] = (0, 0)


def _downsized(config: Any, height: int, width: int, side: int) -> tuple[int, int]:
    """OneVision's ``anyres_max_N`` bilinear downsizing of an unpadded ``height x width`` grid."""
    if config.model_type != "llava_onevision":
        return height, width
    limit = int(str(getattr(config, "vision_aspect_ratio", "anyres_max_9")).removeprefix("anyres_max_"))
    ratio = math.sqrt(height * width / (limit * side**2))
    return (int(height // ratio), int(width // ratio)) if ratio > 1.1 else (height, width)


def layout_from_size(config: Any, size: Any, patching: bool = True) -> TileLayout:
    """The layout the model builds for an image of original ``size`` ``(height, width)``."""
    from transformers.models.llava_next import modeling_llava_next as modeling

    if not patching:
        return TileLayout(crops=1)
    side = config.vision_config.image_size // config.vision_config.patch_size
    size = [int(v) for v in (size.tolist() if hasattr(size, "tolist") else size)]
    rows, cols = modeling.get_anyres_image_grid_shape(size, config.image_grid_pinpoints, config.vision_config.image_size)
    unpadded = tuple(modeling.unpad_image(torch.zeros(1, rows * side, cols * side), size).shape[1:])
    return TileLayout(1 + rows * cols, rows, cols, unpadded, _downsized(config, *unpadded, side))


def _candidates(config: Any, final: tuple[int, int], side: int) -> list[TileLayout]:
    """Layouts whose tile grid packs to ``final`` (``h x w`` without the newline column)."""
    size = config.vision_config.image_size
    grids = sorted({(int(h) // size, int(w) // size) for h, w in config.image_grid_pinpoints})
    found = []
    for rows, cols in grids:
        full_h, full_w = rows * side, cols * side
        shapes = {(full_h - 2 * p, full_w) for p in range(full_h // 2)} | {(full_h, full_w - 2 * p) for p in range(full_w // 2)}
        for unpadded in sorted(shapes, reverse=True):
            if _downsized(config, *unpadded, side) == final:
                found.append(TileLayout(1 + rows * cols, rows, cols, unpadded, final))
    return found


def layouts_from_features(config: Any, packed: list[torch.Tensor], newline: torch.Tensor, crops: int) -> list[TileLayout]:
    """Recover each image's layout from its packed features ``[F_i, D]`` and the vision-tower batch ``crops``."""
    side = config.vision_config.image_size // config.vision_config.patch_size
    options = []
    for features in packed:
        marks = (features == newline.to(features.dtype)).all(dim=-1)
        if features.shape[0] == side * side + 1 and bool(marks[-1]):
            options.append([TileLayout(crops=1)])
            continue
        tail = marks[side * side:].nonzero().flatten()
        if tail.numel() == 0:
            raise ValueError("vflowopt could not find the image-newline tokens that mark the tile rows.")
        height, width = int(tail.numel()), int(tail[0])
        options.append(_candidates(config, (height, width), side))
    for combination in itertools.product(*options):
        if sum(layout.crops for layout in combination) == crops:
            return list(combination)
    raise ValueError("vflowopt could not recover the anyres tile layout of these images; pass image_sizes "
                     "(a plain forward with the processor outputs) or use 'transprune' / 'fastv'.")


def tile_values(crops: torch.Tensor, layout: TileLayout, side: int) -> torch.Tensor:
    """``[F]`` values of one image in feature order from its per-crop values ``[P, side * side]``; newlines 1.0."""
    base = crops[0]
    if layout.crops == 1:
        return torch.cat([base, base.new_ones(1)])
    rows, cols = layout.rows, layout.cols
    grid = crops[1:1 + rows * cols].reshape(rows, cols, side, side).permute(0, 2, 1, 3).reshape(rows * side, cols * side)
    height, width = layout.unpadded
    top, left = (rows * side - height) // 2, (cols * side - width) // 2
    grid = grid[top:top + height, left:left + width]
    if layout.final != layout.unpadded:
        grid = torch.nn.functional.interpolate(grid[None, None], list(layout.final), mode="bilinear")[0, 0]
    grid = torch.cat([grid, grid.new_ones(grid.shape[0], 1)], dim=1)
    return torch.cat([base, grid.reshape(-1)])


def image_layouts(adapter: Any, inputs: dict, crops: int) -> list[TileLayout]:
    """Layouts of the call's images: from ``image_sizes`` if present, else from ``mm_encoder_outputs``."""
    config = adapter.config
    sizes = inputs.get("image_sizes")
    if sizes is not None:
        patching = [True] * len(sizes)
        batch_images = inputs.get("batch_num_images")
        if config.model_type == "llava_onevision" and batch_images is not None:
            patching = [int(n) == 1 for n in batch_images for _ in range(int(n))]
        return [layout_from_size(config, s, p) for s, p in zip(sizes, patching, strict=True)]
    encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
    packed = getattr(encoded, "pooler_output", None)
    if packed is None:
        raise ValueError(f"vflowopt needs the processor's image_sizes (or generate's pre-encoded images) for "
                         f"{config.model_type} inputs.")
    return layouts_from_features(config, list(packed), adapter.backbone.image_newline, crops)
