"""The demo's pure picture functions (demos/overlay.py): sizes, kept vs greyed cells, colormaps, strips."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vtprune.demo.cli import load_demo_module

overlay = load_demo_module("overlay")


def _image(side: int = 112, rgb: tuple[int, int, int] = (200, 40, 40)) -> Image.Image:
    return Image.new("RGB", (side, side), rgb)


def _cell(picture: Image.Image, grid: int, index: int) -> np.ndarray:
    """Pixels of cell ``index`` of a ``grid x grid`` layout, without its 3-pixel border."""
    x0, y0, x1, y1 = overlay.cell_boxes(grid, grid, *picture.size)[index]
    return np.asarray(picture)[y0 + 3:y1 - 3, x0 + 3:x1 - 3].astype(int)


def test_cell_boxes_tile_the_image_exactly() -> None:
    boxes = overlay.cell_boxes(3, 5, 100, 61)
    assert len(boxes) == 15
    area = sum((x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in boxes)
    assert area == 100 * 61
    assert boxes[0][:2] == (0, 0) and boxes[-1][2:] == (100, 61)
    with pytest.raises(ValueError, match="at least 1 x 1"):
        overlay.cell_boxes(0, 4, 10, 10)


def test_cell_mask_ignores_out_of_range() -> None:
    mask = overlay.cell_mask([0, 3, 3, 9, -1], 4)
    assert mask.tolist() == [True, False, False, True]


def test_kept_overlay_keeps_colour_and_greys_pruned_cells() -> None:
    picture = overlay.kept_overlay(_image(), 8, 8, kept=[0, 9], side=448)
    assert picture.size == (448, 448) and picture.mode == "RGB"
    kept, pruned = _cell(picture, 8, 9), _cell(picture, 8, 10)
    assert np.allclose(kept.mean(axis=(0, 1)), (200, 40, 40), atol=3)
    channels = pruned.mean(axis=(0, 1))
    assert channels.max() - channels.min() < 2, "pruned cells are grey"
    assert channels.mean() < kept.mean(axis=(0, 1)).max() / 2, "pruned cells are darkened"


def test_kept_overlay_outlines_merged_cells() -> None:
    plain = np.asarray(overlay.kept_overlay(_image(), 4, 4, kept=[5], side=200))
    merged = np.asarray(overlay.kept_overlay(_image(), 4, 4, kept=[5], merged=[5], side=200))
    x0, y0, x1, y1 = overlay.cell_boxes(4, 4, 200, 200)[5]
    border = merged[y0 + 2, x0 + 5:x1 - 5]
    assert np.allclose(border, overlay.MERGED_RGB, atol=1)
    assert not np.array_equal(plain, merged)
    assert np.array_equal(plain[y0 + 8:y1 - 8, x0 + 8:x1 - 8], merged[y0 + 8:y1 - 8, x0 + 8:x1 - 8])


def test_display_image_keeps_aspect() -> None:
    picture = overlay.display_image(Image.new("L", (200, 100)), side=300)
    assert picture.size == (300, 150) and picture.mode == "RGB"


def test_normalize_scores_min_max_nan_and_constant() -> None:
    unit = overlay.normalize_scores(np.array([[1.0, 3.0], [np.nan, 2.0]]))
    assert unit[0, 0] == 0.0 and unit[0, 1] == 1.0 and unit[1, 1] == 0.5 and np.isnan(unit[1, 0])
    assert np.all(overlay.normalize_scores(np.full((2, 2), 7.0)) == 0.5)
    assert np.isnan(overlay.normalize_scores(np.full((2, 2), np.nan))).all()


def test_scores_to_grid_checks_size() -> None:
    assert overlay.scores_to_grid(range(6), 2, 3).shape == (2, 3)
    with pytest.raises(ValueError, match="6 scores for a 2 x 2"):
        overlay.scores_to_grid(range(6), 2, 2)


def test_colorize_high_is_red_low_is_blue_missing_is_grey() -> None:
    colours = overlay.colorize(np.array([[0.0, 1.0, np.nan]]), 3, 1)
    low, high, missing = colours[0]
    assert high[0] > high[2] and low[2] > low[0]
    assert tuple(missing) == overlay.MISSING_RGB


def test_heatmap_overlay_blends_with_alpha() -> None:
    grid = np.array([[0.0, 1.0], [0.5, np.nan]])
    base = _image(64, (0, 0, 0))
    opaque = np.asarray(overlay.heatmap_overlay(base, grid, alpha=1.0, side=64))
    half = np.asarray(overlay.heatmap_overlay(base, grid, alpha=0.5, side=64))
    assert opaque.shape == (64, 64, 3)
    assert np.allclose(half.astype(int), np.round(opaque / 2), atol=1)
    assert tuple(opaque[48, 48]) == overlay.MISSING_RGB
    with pytest.raises(ValueError, match="alpha"):
        overlay.heatmap_overlay(base, grid, alpha=1.5)


def test_gridprobe_map_outlines_selected_cells() -> None:
    matrix = np.arange(9, dtype=float).reshape(3, 3) / 10
    picture = overlay.gridprobe_map(matrix, selected=[8], side=300)
    assert picture.size == (300, 300)
    pixels = np.asarray(picture)
    x0, y0, x1, y1 = overlay.cell_boxes(3, 3, 300, 300)[8]
    assert tuple(pixels[y0 + 2, (x0 + x1) // 2]) == overlay.SELECTED_RGB
    x0, y0, x1, y1 = overlay.cell_boxes(3, 3, 300, 300)[0]
    assert tuple(pixels[y0 + 2, (x0 + x1) // 2]) != overlay.SELECTED_RGB
    with pytest.raises(ValueError, match="K x K"):
        overlay.gridprobe_map(np.zeros((2, 3)))


def test_frame_strip_lays_out_rows_with_labels() -> None:
    frames = [_image(40, (10 * i, 0, 0)) for i in range(5)]
    strip = overlay.frame_strip(frames, [f"{i}.0 s" for i in range(5)], height=40, per_row=3, gap=4,
                                label_height=16)
    assert strip.size == (3 * 44 + 4, 2 * (40 + 16 + 4) + 4)
    assert tuple(np.asarray(strip)[4 + 20, 4 + 20]) == (0, 0, 0)
    with pytest.raises(ValueError, match="labels"):
        overlay.frame_strip(frames, ["a"])
    with pytest.raises(ValueError, match="at least one frame"):
        overlay.frame_strip([], [])
