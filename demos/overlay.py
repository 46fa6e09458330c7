"""Pure picture functions of the demo: arrays / PIL images in, PIL images out (no model, no Gradio).

* :func:`kept_overlay` - the image with kept visual-token cells in colour, pruned cells greyed out and
  recycled / merged cells outlined.
* :func:`heatmap_overlay` - per-token importance scores as an OpenCV colormap blended over the image.
* :func:`gridprobe_map` - GridProbe's ``K x K`` frame-importance map with the selected cells outlined.
* :func:`frame_strip` - selected video frames side by side with their timestamps.

Token grids are ``h x w`` in row-major (grid) order, the order of ``CallStats.kept_indices``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import cv2
import numpy as np
from PIL import Image, ImageDraw, ImageFont

MERGED_RGB = (0, 229, 255)
SELECTED_RGB = (255, 255, 255)
GRID_RGB = (255, 255, 255)
MISSING_RGB = (70, 70, 70)


def display_image(image: Image.Image, side: int = 448) -> Image.Image:
    """``image`` as RGB, scaled (aspect kept) so that its longer side is ``side`` pixels."""
    rgb = image.convert("RGB")
    scale = side / max(rgb.size)
    size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
    return rgb.resize(size, Image.Resampling.BICUBIC)


def cell_boxes(grid_h: int, grid_w: int, width: int, height: int) -> list[tuple[int, int, int, int]]:
    """Pixel boxes ``(x0, y0, x1, y1)`` (end-exclusive) of the ``grid_h x grid_w`` cells, row-major."""
    if grid_h <= 0 or grid_w <= 0:
        raise ValueError(f"the token grid must be at least 1 x 1, got {grid_h} x {grid_w}.")
    ys = np.linspace(0, height, grid_h + 1).round().astype(int)
    xs = np.linspace(0, width, grid_w + 1).round().astype(int)
    return [(int(xs[c]), int(ys[r]), int(xs[c + 1]), int(ys[r + 1])) for r in range(grid_h) for c in range(grid_w)]


def cell_mask(indices: Iterable[int], count: int) -> np.ndarray:
    """Bool ``[count]`` mask with ``True`` at ``indices`` (indices outside ``[0, count)`` are ignored)."""
    mask = np.zeros(count, dtype=bool)
    index = np.asarray([i for i in indices if 0 <= int(i) < count], dtype=int)
    mask[index] = True
    return mask


def _grey_out(rgb: np.ndarray) -> np.ndarray:
    """Desaturated and darkened copy of ``rgb`` (uint8 ``[H, W, 3]``)."""
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).astype(np.float32)
    faded = 0.3 * grey + 25.0
    return np.repeat(faded[..., None], 3, axis=2).astype(np.uint8)


def kept_overlay(image: Image.Image, grid_h: int, grid_w: int, kept: Iterable[int],
                 merged: Iterable[int] = (), side: int = 448) -> Image.Image:
    """The image with kept token cells in colour, pruned cells greyed out and merged cells outlined.

    kept / merged: token ordinals in grid order (``row * grid_w + col``); ``merged`` marks kept cells whose
    features absorbed pruned tokens (recycling / merging methods). Returns an RGB image of longer side ``side``.
    """
    base = np.asarray(display_image(image, side))
    height, width = base.shape[:2]
    boxes = cell_boxes(grid_h, grid_w, width, height)
    keep = cell_mask(kept, len(boxes))
    out = _grey_out(base)
    for (x0, y0, x1, y1), alive in zip(boxes, keep, strict=True):
        if alive:
            out[y0:y1, x0:x1] = base[y0:y1, x0:x1]
    picture = Image.fromarray(out)
    draw = ImageDraw.Draw(picture, "RGBA")
    for (x0, y0, x1, y1), alive in zip(boxes, keep, strict=True):
        if alive:
            draw.rectangle((x0, y0, x1 - 1, y1 - 1), outline=(*GRID_RGB, 110), width=1)
    line = max(2, width // 150)
    for index in np.flatnonzero(cell_mask(merged, len(boxes))):
        x0, y0, x1, y1 = boxes[index]
        draw.rectangle((x0 + 1, y0 + 1, x1 - 2, y1 - 2), outline=(*MERGED_RGB, 255), width=line)
    return picture


def scores_to_grid(scores: Sequence[float] | np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
    """``[grid_h, grid_w]`` float array from per-ordinal scores (``NaN`` marks tokens that were not scored)."""
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    if values.size != grid_h * grid_w:
        raise ValueError(f"got {values.size} scores for a {grid_h} x {grid_w} token grid.")
    return values.reshape(grid_h, grid_w)


def normalize_scores(grid: np.ndarray) -> np.ndarray:
    """Finite values of ``grid`` min-max scaled to ``[0, 1]`` (a constant map gives 0.5); ``NaN`` stays ``NaN``."""
    values = np.asarray(grid, dtype=np.float64)
    finite = np.isfinite(values)
    out = np.full(values.shape, np.nan)
    if not finite.any():
        return out
    low, high = values[finite].min(), values[finite].max()
    out[finite] = 0.5 if high - low <= 1e-12 else (values[finite] - low) / (high - low)
    return out


def colorize(grid: np.ndarray, width: int, height: int, colormap: int = cv2.COLORMAP_TURBO) -> np.ndarray:
    """RGB uint8 ``[height, width, 3]``: ``grid`` normalised, one flat colour per cell, ``NaN`` cells grey."""
    unit = normalize_scores(grid)
    levels = np.nan_to_num(unit, nan=0.0)
    small = cv2.applyColorMap((levels * 255).round().astype(np.uint8), colormap)
    small = cv2.cvtColor(small, cv2.COLOR_BGR2RGB)
    small[~np.isfinite(unit)] = MISSING_RGB
    return cv2.resize(small, (width, height), interpolation=cv2.INTER_NEAREST)


def heatmap_overlay(image: Image.Image, grid: np.ndarray, alpha: float = 0.55, side: int = 448,
                    colormap: int = cv2.COLORMAP_TURBO) -> Image.Image:
    """``grid`` (``[h, w]`` scores, ``NaN`` = not scored) as a colormap blended over ``image`` at ``alpha``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}.")
    base = np.asarray(display_image(image, side)).astype(np.float32)
    height, width = base.shape[:2]
    heat = colorize(np.asarray(grid, dtype=np.float64), width, height, colormap).astype(np.float32)
    return Image.fromarray((alpha * heat + (1.0 - alpha) * base).round().astype(np.uint8))


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has no sized default font
        return ImageFont.load_default()


def gridprobe_map(matrix: np.ndarray, selected: Iterable[int] = (), side: int = 320,
                  colormap: int = cv2.COLORMAP_TURBO) -> Image.Image:
    """GridProbe's ``K x K`` importance map (cell ``r*K + c`` = frame candidate) with values and selected cells.

    matrix: ``[K, K]`` scores; selected: cell indices (row-major) of the frames kept for the focused pass.
    """
    grid = np.asarray(matrix, dtype=np.float64)
    if grid.ndim != 2 or grid.shape[0] != grid.shape[1] or grid.size == 0:
        raise ValueError(f"the GridProbe map must be a non-empty K x K array, got shape {grid.shape}.")
    k = grid.shape[0]
    picture = Image.fromarray(colorize(grid, side, side, colormap))
    draw = ImageDraw.Draw(picture)
    boxes = cell_boxes(k, k, side, side)
    font = _font(max(8, side // (4 * k)))
    unit = np.nan_to_num(normalize_scores(grid), nan=0.0).reshape(-1)
    for index, (x0, y0, x1, y1) in enumerate(boxes):
        value = grid.reshape(-1)[index]
        text = "-" if not np.isfinite(value) else f"{value:.3f}"
        color = (0, 0, 0) if 0.2 < unit[index] < 0.8 else (255, 255, 255)
        draw.text(((x0 + x1) / 2, (y0 + y1) / 2), text, fill=color, font=font, anchor="mm")
    line = max(2, side // (12 * k))
    for index in np.flatnonzero(cell_mask(selected, k * k)):
        x0, y0, x1, y1 = boxes[index]
        draw.rectangle((x0 + 1, y0 + 1, x1 - 2, y1 - 2), outline=SELECTED_RGB, width=line)
        draw.rectangle((x0 + 1 + line, y0 + 1 + line, x1 - 2 - line, y1 - 2 - line), outline=(0, 0, 0), width=1)
    return picture


def frame_strip(frames: Sequence[Image.Image], labels: Sequence[str], height: int = 128, per_row: int = 8,
                gap: int = 6, label_height: int = 22) -> Image.Image:
    """Frames scaled to ``height``, ``per_row`` to a row, each with its label (e.g. a timestamp) underneath."""
    if not frames:
        raise ValueError("frame_strip needs at least one frame.")
    if len(labels) != len(frames):
        raise ValueError(f"got {len(labels)} labels for {len(frames)} frames.")
    if per_row < 1:
        raise ValueError(f"per_row must be >= 1, got {per_row}.")
    tiles = [f.convert("RGB").resize((max(1, round(f.width * height / f.height)), height)) for f in frames]
    cell_w, cell_h = max(t.width for t in tiles) + gap, height + label_height + gap
    columns, rows = min(per_row, len(tiles)), -(-len(tiles) // per_row)
    strip = Image.new("RGB", (columns * cell_w + gap, rows * cell_h + gap), (250, 250, 250))
    draw = ImageDraw.Draw(strip)
    font = _font(max(10, label_height - 8))
    for number, (tile, label) in enumerate(zip(tiles, labels, strict=True)):
        x, y = gap + (number % per_row) * cell_w, gap + (number // per_row) * cell_h
        strip.paste(tile, (x, y))
        draw.text((x + tile.width / 2, y + height + label_height / 2 + 1), label, fill=(30, 30, 30), font=font,
                  anchor="mm")
    return strip
