"""vtprune-shapes "dense" task version: 224 px scenes of 6-12 objects, 64 tokens of 28 px, readable digits.

A second task version next to :mod:`vtprune.shapes.task` (whose 112 px, 16-token task and splits are left
untouched). Differences, all chosen so that a tiny LLaVA with 28 px patches (8x8 = 64 visual tokens) can
learn every question type:

* **Denser scenes**: 6-12 shapes per image (``DenseConfig.objects``), each 20-28 px (about one patch).
* **Readable numbers**: a 2-3 digit number drawn with **one digit per patch**, each digit 20-24 px tall
  inside its own 28 px patch, on consecutive patches of one patch row. So each digit is one visual token
  and reading means reading those tokens left to right.
* **Grounding on a finer grid** (``where3``): every shape lies entirely inside one cell of a 3x3 grid of
  the image, and ``Where exactly is the {color} {shape}?`` is answered with the cell's name (``CELLS``:
  ``top-left``, ``top``, ``top-right``, ``left``, ``center``, ...). The cells (75 px) do not line up with
  the 28 px patches, so the answer needs the object's exact place. The quadrant ``where`` of the first
  task version is not asked (objects in the middle row or column belong to no quadrant).
* **A curriculum knob**: ``difficulty`` in [0, 1] scales the number of objects (2-6 at 0, 6-12 at 1) and
  the clutter; validation and test samples always use 1.

Streams are seeded by ``(seed, index, DENSE_STREAM)``, so they never coincide with the first version's
``(seed, index)`` streams, and the split seeds are the same :data:`vtprune.shapes.task.SPLIT_SEEDS`.
Every question carries its evidence boxes (``read``: one box per digit). See docs/shapes_task.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import ImageDraw

from vtprune.shapes import task as S

DENSE_VERSION = "dense-v1"
DENSE_STREAM = 64  # third word of every dense sample's RNG key
CELLS: tuple[str, ...] = ("top-left", "top", "top-right", "left", "center", "right",
                          "bottom-left", "bottom", "bottom-right")
DENSE_QTYPES: tuple[str, ...] = ("color", "shape", "count", "exists", "where3", "read")
DENSE_TEMPLATES: dict[str, str] = {
    "color": S.TEMPLATES["color"],
    "shape": S.TEMPLATES["shape"],
    "count": S.TEMPLATES["count"],
    "exists": S.TEMPLATES["exists"],
    "where3": "Where exactly is the {color} {shape}?",
    "read": S.TEMPLATES["read"],
}
MAX_COUNT = 5  # count answers are 0..5 (S.COUNT_ANSWERS)


@dataclass
class DenseConfig:
    """Settings of the dense task version (pixel sizes; ``image_size`` must be ``grid * patch``)."""

    image_size: int = 224
    patch: int = 28
    objects: tuple[int, int] = (6, 12)
    easy_objects: tuple[int, int] = (2, 6)  # at difficulty 0 (curriculum start)
    object_px: tuple[int, int] = (20, 28)
    digit_height_px: tuple[int, int] = (20, 24)
    digit_width_px: tuple[int, int] = (13, 17)
    number_range: tuple[int, int] = (10, 999)
    color_jitter: int = 18
    noise_sigma: float = 8.0
    clutter: int = 40
    hard_negative_frac: float = 0.75

    @property
    def grid(self) -> int:
        return self.image_size // self.patch


def cell_edges(size: int) -> np.ndarray:
    """Pixel edges of the 3x3 grid of cells: ``[0, e1, e2, size]``."""
    return np.linspace(0, size, 4).round().astype(int)


def cell_of(box: S.Box, size: int) -> str:
    """Name of the 3x3 cell that holds the centre of ``box``."""
    edges = cell_edges(size)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    col = int(np.searchsorted(edges, cx, side="right")) - 1
    row = int(np.searchsorted(edges, cy, side="right")) - 1
    return CELLS[min(row, 2) * 3 + min(col, 2)]


def _place_in_cell(rng: np.random.Generator, side: int, size: int, taken: list[S.Box]) -> S.Box | None:
    """A free ``side`` x ``side`` box lying fully inside a random 3x3 cell, 1 px from its edges."""
    edges = cell_edges(size)
    for _ in range(80):
        cell = int(rng.integers(9))
        cx0, cy0 = edges[cell % 3], edges[cell // 3]
        cw, ch = edges[cell % 3 + 1] - cx0, edges[cell // 3 + 1] - cy0
        x0 = int(cx0) + 1 + int(rng.integers(0, cw - side - 1))
        y0 = int(cy0) + 1 + int(rng.integers(0, ch - side - 1))
        box = (x0, y0, x0 + side, y0 + side)
        if not S._overlaps(box, taken):
            return box
    return None


def _scene_spec(rng: np.random.Generator, n: int) -> tuple[list[tuple[str, str]], str]:
    """``n`` (shape, colour) pairs and the count shape.

    ``c`` (uniform 0..5) copies of the count shape, exactly one of a second shape (so a colour question
    exists), the rest of the two remaining shapes; one object gets a colour no other object has (so a
    shape question exists), the others colours drawn from the remaining five.
    """
    order = [str(s) for s in rng.permutation(S.SHAPES)]
    count_shape, unique_shape, rest = order[0], order[1], order[2:]
    c = min(int(rng.integers(0, MAX_COUNT + 1)), n - 1)
    shapes = [count_shape] * c + [unique_shape] + [rest[int(rng.integers(2))] for _ in range(n - c - 1)]
    shapes = [shapes[i] for i in rng.permutation(n)]
    palette = [str(col) for col in rng.permutation(S.COLORS)]
    reserved, others = palette[0], palette[1:]
    colors = [others[int(rng.integers(len(others)))] for _ in range(n)]
    colors[int(rng.integers(n))] = reserved
    return list(zip(shapes, colors, strict=True)), count_shape


def _render_number(rng: np.random.Generator, draw: ImageDraw.ImageDraw, cfg: DenseConfig, taken: list[S.Box]
                   ) -> tuple[str, list[S.SceneObject]]:
    """A number with one digit per patch, on consecutive patches of one patch row."""
    lo, hi = cfg.number_range
    number = str(int(rng.integers(lo, hi + 1)))
    g, p = cfg.grid, cfg.patch
    row, col0 = int(rng.integers(g)), int(rng.integers(0, g - len(number) + 1))
    ink = (20, 20, 20) if rng.random() < 0.5 else (245, 245, 245)
    dh = int(rng.integers(cfg.digit_height_px[0], cfg.digit_height_px[1] + 1))
    dw = int(rng.integers(cfg.digit_width_px[0], cfg.digit_width_px[1] + 1))
    digits = []
    for i, ch in enumerate(number):
        px, py = (col0 + i) * p, row * p
        x0 = px + 1 + int(rng.integers(0, p - dw - 1))
        y0 = py + 1 + int(rng.integers(0, p - dh - 1))
        box = (x0, y0, x0 + dw, y0 + dh)
        S._draw_digit(draw, ch, box, ink)
        digits.append(S.SceneObject(box=box, quadrant=cell_of(box, cfg.image_size), digit=ch))
        taken.append((px, py, px + p, py + p))  # shapes never enter a digit's patch
    return number, digits


def render_dense_scene(seed: int, index: int, cfg: DenseConfig, difficulty: float = 1.0):
    """Render one dense image: ``(image, objects, number, number_box, count_shape, rng)``.

    ``SceneObject.quadrant`` holds the object's 3x3 cell name (:data:`CELLS`) in this task version.
    """
    rng = np.random.default_rng([int(seed), int(index), DENSE_STREAM])
    d = float(np.clip(difficulty, 0.0, 1.0))
    size = cfg.image_size
    bg_cfg = S.ShapesConfig(image_size=size, noise_sigma=cfg.noise_sigma, clutter=int(round(cfg.clutter * d)))
    img = S._background(rng, size, bg_cfg)
    draw = ImageDraw.Draw(img)
    lo = int(round(cfg.easy_objects[0] + d * (cfg.objects[0] - cfg.easy_objects[0])))
    hi = int(round(cfg.easy_objects[1] + d * (cfg.objects[1] - cfg.easy_objects[1])))
    spec, count_shape = _scene_spec(rng, int(rng.integers(lo, hi + 1)))
    taken: list[S.Box] = []
    number, digits = _render_number(rng, draw, cfg, taken)
    objects: list[S.SceneObject] = []
    for shape, color in spec:
        side = int(rng.integers(cfg.object_px[0], cfg.object_px[1] + 1))
        box = _place_in_cell(rng, side, size, taken)
        if box is None:
            continue
        taken.append(box)
        S._draw_shape(draw, shape, box, S._jitter(rng, S.PALETTE[color], cfg.color_jitter))
        objects.append(S.SceneObject(box=box, quadrant=cell_of(box, size), shape=shape, color=color))
    number_box = (digits[0].box[0], min(o.box[1] for o in digits), digits[-1].box[2], max(o.box[3] for o in digits))
    return img, objects + digits, number, number_box, count_shape, rng


def make_dense_questions(rng: np.random.Generator, objects: list[S.SceneObject], number: str, count_shape: str,
                         cfg: DenseConfig) -> list[S.Question]:
    """One question per type the scene answers unambiguously (order: :data:`DENSE_QTYPES`)."""
    shapes = [o for o in objects if o.shape is not None]
    digits = [o for o in objects if o.digit is not None]
    qs: list[S.Question] = []
    uniq_shape = [s for s in S.SHAPES if sum(o.shape == s for o in shapes) == 1]
    if uniq_shape:
        shape = S._pick(rng, uniq_shape)
        o = next(o for o in shapes if o.shape == shape)
        qs.append(S.Question("color", DENSE_TEMPLATES["color"].format(shape=o.shape), o.color, [o.box]))
    uniq_color = [c for c in S.COLORS if sum(o.color == c for o in shapes) == 1]
    if uniq_color:
        color = S._pick(rng, uniq_color)
        o = next(o for o in shapes if o.color == color)
        qs.append(S.Question("shape", DENSE_TEMPLATES["shape"].format(color=o.color), o.shape, [o.box]))
    same = [o.box for o in shapes if o.shape == count_shape]
    qs.append(S.Question("count", DENSE_TEMPLATES["count"].format(plural=S.PLURALS[count_shape]), str(len(same)),
                         same))
    qs.append(S._exists_question(rng, shapes, cfg))  # reads only cfg.hard_negative_frac
    uniq_pair = [o for o in shapes if sum((p.color, p.shape) == (o.color, o.shape) for p in shapes) == 1]
    if uniq_pair:
        o = S._pick(rng, uniq_pair)
        qs.append(S.Question("where3", DENSE_TEMPLATES["where3"].format(color=o.color, shape=o.shape), o.quadrant,
                             [o.box]))
    qs.append(S.Question("read", DENSE_TEMPLATES["read"], number, [o.box for o in digits]))
    return qs


def generate_dense_sample(seed: int, index: int, cfg: DenseConfig | None = None, difficulty: float = 1.0
                          ) -> S.ImageSample:
    """Deterministic dense sample ``index`` of stream ``seed`` (same arguments -> identical pixels, questions).

    ``difficulty`` < 1 (the scene curriculum) is for training; val/test always use 1.
    """
    cfg = cfg or DenseConfig()
    img, objects, number, number_box, count_shape, rng = render_dense_scene(seed, index, cfg, difficulty)
    qs = make_dense_questions(rng, objects, number, count_shape, cfg)
    return S.ImageSample(img, objects, number, number_box, qs, seed, index)


def make_dense_split(split: str, n: int, cfg: DenseConfig | None = None, offset: int = 0) -> list[S.ImageSample]:
    """``n`` dense samples of ``split`` (train/val/test/calib) at full difficulty; disjoint seed streams."""
    if split not in S.SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(S.SPLIT_SEEDS)}, got {split!r}")
    return [generate_dense_sample(S.SPLIT_SEEDS[split], offset + i, cfg) for i in range(n)]
