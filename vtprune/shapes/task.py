"""The "vtprune-shapes" synthetic VQA task: seeded, deterministic images and videos with known evidence.

Each image shows a few small coloured shapes and one small 7-segment number on a textured, cluttered grey
background. Every object lies entirely inside one image quadrant (so "where" is unambiguous) and may sit in
any quadrant. Each :class:`Question` carries the pixel boxes of the objects that answer it, so the evidence
visual tokens are known exactly (:func:`evidence_mask`).

All vocabulary (templates, palette, shapes, answers) lives in the constants below; see docs/shapes_task.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# ----------------------------------------------------------------------------------------------------------
# Task vocabulary (single source of truth)
# ----------------------------------------------------------------------------------------------------------
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
QUADRANTS: tuple[str, ...] = ("top-left", "top-right", "bottom-left", "bottom-right")
YES_NO: tuple[str, ...] = ("yes", "no")
COUNT_ANSWERS: tuple[str, ...] = tuple(str(i) for i in range(6))
QTYPES: tuple[str, ...] = ("color", "shape", "count", "exists", "where", "read")
TEMPLATES: dict[str, str] = {
    "color": "What color is the {shape}?",
    "shape": "What shape is the {color} object?",
    "count": "How many {plural} are there?",
    "exists": "Is there a {color} {shape}?",
    "where": "Where is the {color} {shape}?",
    "read": "What number is written in the image?",
}
VIDEO_TEMPLATES: dict[str, str] = {
    "color": "What color is the {shape} that appears in the video?",
    "shape": "What shape is the {color} object that appears in the video?",
}
VIDEO_SUFFIX = "Answer with the letter."
OPTION_LETTERS: tuple[str, ...] = ("A", "B", "C", "D")
SPLIT_SEEDS: dict[str, int] = {"train": 1_000_003, "val": 2_000_003, "test": 3_000_017, "calib": 4_000_037}
DIGIT_SEGMENTS: dict[str, str] = {
    "0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc",
    "5": "afgcd", "6": "afgedc", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}

Box = tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels, end-exclusive


@dataclass
class ShapesConfig:
    """Generator settings; sizes are fractions of ``image_size`` so the task scales with resolution."""

    image_size: int = 112
    min_objects: int = 3
    max_extra_objects: int = 3
    object_frac: tuple[float, float] = (0.16, 0.23)
    digit_height_frac: tuple[float, float] = (0.11, 0.14)
    number_range: tuple[int, int] = (10, 999)
    color_jitter: int = 18
    noise_sigma: float = 8.0
    clutter: int = 14
    hard_negative_frac: float = 0.75
    video_frames: tuple[int, int] = (16, 32)
    video_evidence_frames: tuple[int, int] = (2, 4)


@dataclass
class SceneObject:
    """One coloured shape (``shape``/``color`` set) or one digit of the number (``digit`` set)."""

    box: Box
    quadrant: str
    shape: str | None = None
    color: str | None = None
    digit: str | None = None


@dataclass
class Question:
    """A question with its one-word answer and the pixel boxes of the evidence objects."""

    qtype: str
    text: str
    answer: str
    boxes: list[Box] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)  # video only: frames that hold the evidence


@dataclass
class ImageSample:
    """A rendered image, its objects (shapes and digits) and one question per answerable type."""

    image: Image.Image
    objects: list[SceneObject]
    number: str
    number_box: Box
    questions: list[Question]
    seed: int
    index: int

    @property
    def shapes(self) -> list[SceneObject]:
        return [o for o in self.objects if o.shape is not None]


@dataclass
class VideoSample:
    """A clip (list of PIL frames) with multiple-choice questions whose evidence is in a few frames."""

    frames: list[Image.Image]
    questions: list[Question]
    seed: int
    index: int


# ----------------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------------
def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(index)])


def _background(rng: np.random.Generator, size: int, cfg: ShapesConfig) -> Image.Image:
    """Low-frequency grey texture with a faint tint, pixel noise and grey clutter strokes."""
    coarse = rng.uniform(85, 175, size=(6, 6)).astype(np.float32)
    tex = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BILINEAR), dtype=np.float32)
    tint = rng.uniform(-8, 8, size=3).astype(np.float32)
    arr = tex[..., None] + tint + rng.normal(0, cfg.noise_sigma, size=(size, size, 3)).astype(np.float32)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(cfg.clutter):
        g = int(rng.integers(60, 200))
        x, y = (int(v) for v in rng.integers(0, size, 2))
        if rng.random() < 0.5:
            dx, dy = (int(v) for v in rng.integers(-size // 6, size // 6, 2))
            draw.line([x, y, x + dx, y + dy], fill=(g, g, g), width=1)
        else:
            r = int(rng.integers(1, 3))
            draw.ellipse([x - r, y - r, x + r, y + r], fill=(g, g, g))
    return img


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: Box, rgb: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    x1, y1 = x1 - 1, y1 - 1
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=rgb)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=rgb)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=rgb)
    elif shape == "cross":
        t = max(2, (x1 - x0) // 3)
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        draw.rectangle([cx - t // 2, y0, cx - t // 2 + t, y1], fill=rgb)
        draw.rectangle([x0, cy - t // 2, x1, cy - t // 2 + t], fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _draw_digit(draw: ImageDraw.ImageDraw, digit: str, box: Box, rgb: tuple[int, int, int]) -> None:
    """Seven-segment digit filling ``box``."""
    x0, y0, x1, y1 = box
    h = y1 - y0
    t = max(2, h // 7)
    ym = y0 + (h - t) // 2
    seg = {
        "a": (x0, y0, x1, y0 + t), "d": (x0, y1 - t, x1, y1), "g": (x0, ym, x1, ym + t),
        "f": (x0, y0, x0 + t, ym + t), "b": (x1 - t, y0, x1, ym + t),
        "e": (x0, ym, x0 + t, y1), "c": (x1 - t, ym, x1, y1),
    }
    for s in DIGIT_SEGMENTS[digit]:
        a, b, c, d = seg[s]
        draw.rectangle([a, b, c - 1, d - 1], fill=rgb)


def _quadrant_of(box: Box, size: int) -> str:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return QUADRANTS[(2 if cy >= size / 2 else 0) + (1 if cx >= size / 2 else 0)]


def _overlaps(box: Box, others: list[Box], gap: int = 1) -> bool:
    return any(
        box[0] < o[2] + gap and o[0] < box[2] + gap and box[1] < o[3] + gap and o[1] < box[3] + gap for o in others
    )


def _place(rng: np.random.Generator, w: int, h: int, size: int, taken: list[Box]) -> Box | None:
    """A free box of size w x h lying fully inside a random quadrant (rejection sampling)."""
    half = size // 2
    for _ in range(60):
        q = int(rng.integers(4))
        qx, qy = (q % 2) * half, (q // 2) * half
        if w > half - 2 or h > half - 2:
            return None
        x0 = qx + 1 + int(rng.integers(0, half - w - 1))
        y0 = qy + 1 + int(rng.integers(0, half - h - 1))
        box = (x0, y0, x0 + w, y0 + h)
        if not _overlaps(box, taken):
            return box
    return None


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int], j: int) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.integers(-j, j + 1), 0, 255)) for c in rgb)  # type: ignore[return-value]


def _scene_spec(rng: np.random.Generator, cfg: ShapesConfig) -> list[tuple[str, str]]:
    """(shape, colour) list: ``c`` copies (c uniform 0..5) of a count shape plus a few uniquely shaped others."""
    count_shape = SHAPES[int(rng.integers(len(SHAPES)))]
    c = int(rng.integers(0, 6))
    others = [s for s in SHAPES if s != count_shape]
    n_other = int(rng.integers(max(1, cfg.min_objects - c), cfg.max_extra_objects + 1))
    n_other = min(n_other, len(others))
    shapes = [count_shape] * c + list(rng.permutation(others)[:n_other])
    n = len(shapes)
    if n <= len(COLORS):
        colors = list(rng.permutation(COLORS)[:n])
    else:
        colors = list(rng.permutation(COLORS)) + list(rng.choice(COLORS, n - len(COLORS)))
    spec = [(str(s), str(col)) for s, col in zip(shapes, colors, strict=True)]
    spec.append(("__count__", count_shape))  # sentinel: which shape the count question asks about
    return spec


def _render_number(
    rng: np.random.Generator, draw: ImageDraw.ImageDraw, cfg: ShapesConfig, taken: list[Box]
) -> tuple[str, Box, list[SceneObject]]:
    size = cfg.image_size
    lo, hi = cfg.number_range
    number = str(int(rng.integers(lo, hi + 1)))
    dh = max(9, int(round(size * rng.uniform(*cfg.digit_height_frac))))
    dw, sp = max(5, int(dh * 0.6)), max(2, dh // 6)
    w = len(number) * dw + (len(number) - 1) * sp
    box = _place(rng, w + 2, dh + 2, size, taken)
    assert box is not None, "number must always fit"
    taken.append(box)
    ink = (20, 20, 20) if rng.random() < 0.5 else (245, 245, 245)
    digits = []
    for i, ch in enumerate(number):
        x0 = box[0] + 1 + i * (dw + sp)
        dbox = (x0, box[1] + 1, x0 + dw, box[1] + 1 + dh)
        _draw_digit(draw, ch, dbox, ink)
        digits.append(SceneObject(box=dbox, quadrant=_quadrant_of(box, size), digit=ch))
    return number, box, digits


def render_scene(
    seed: int, index: int, cfg: ShapesConfig
) -> tuple[Image.Image, list[SceneObject], str, Box, str, np.random.Generator]:
    """Render one image; returns (image, objects, number, number_box, count_shape, rng)."""
    rng = _rng(seed, index)
    size = cfg.image_size
    img = _background(rng, size, cfg)
    draw = ImageDraw.Draw(img)
    spec = _scene_spec(rng, cfg)
    count_shape = spec.pop()[1]
    taken: list[Box] = []
    number, number_box, digits = _render_number(rng, draw, cfg, taken)
    objects: list[SceneObject] = []
    for shape, color in spec:
        side = int(round(size * rng.uniform(*cfg.object_frac)))
        box = _place(rng, side, side, size, taken)
        if box is None:
            continue
        taken.append(box)
        _draw_shape(draw, shape, box, _jitter(rng, PALETTE[color], cfg.color_jitter))
        objects.append(SceneObject(box=box, quadrant=_quadrant_of(box, size), shape=shape, color=color))
    return img, objects + digits, number, number_box, count_shape, rng


# ----------------------------------------------------------------------------------------------------------
# Questions
# ----------------------------------------------------------------------------------------------------------
def _pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))]


def _exists_question(rng: np.random.Generator, shapes: list[SceneObject], cfg: ShapesConfig) -> Question:
    present = {(o.color, o.shape) for o in shapes}
    if rng.random() < 0.5 and present:
        col, shp = _pick(rng, sorted(present))
        boxes = [o.box for o in shapes if (o.color, o.shape) == (col, shp)]
        return Question("exists", TEMPLATES["exists"].format(color=col, shape=shp), "yes", boxes)
    absent = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in present]
    cols, shps = {o.color for o in shapes}, {o.shape for o in shapes}
    hard = [(c, s) for c, s in absent if c in cols and s in shps]
    pool = hard if hard and rng.random() < cfg.hard_negative_frac else absent
    col, shp = _pick(rng, pool)
    boxes = [o.box for o in shapes if o.color == col or o.shape == shp]
    return Question("exists", TEMPLATES["exists"].format(color=col, shape=shp), "no", boxes)


def make_questions(
    rng: np.random.Generator, objects: list[SceneObject], number: str, number_box: Box, count_shape: str,
    cfg: ShapesConfig,
) -> list[Question]:
    """One question per type that the scene can answer unambiguously (order: QTYPES)."""
    shapes = [o for o in objects if o.shape is not None]
    by_shape = {s: [o for o in shapes if o.shape == s] for s in SHAPES}
    by_color = {c: [o for o in shapes if o.color == c] for c in COLORS}
    qs: list[Question] = []
    uniq_shape = [s for s in SHAPES if len(by_shape[s]) == 1]
    if uniq_shape:
        o = by_shape[_pick(rng, uniq_shape)][0]
        qs.append(Question("color", TEMPLATES["color"].format(shape=o.shape), o.color, [o.box]))
    uniq_color = [c for c in COLORS if len(by_color[c]) == 1]
    if uniq_color:
        o = by_color[_pick(rng, uniq_color)][0]
        qs.append(Question("shape", TEMPLATES["shape"].format(color=o.color), o.shape, [o.box]))
    cnt = by_shape[count_shape]
    qs.append(Question("count", TEMPLATES["count"].format(plural=PLURALS[count_shape]), str(len(cnt)),
                       [o.box for o in cnt]))
    qs.append(_exists_question(rng, shapes, cfg))
    uniq_pair = [o for o in shapes if sum((p.color, p.shape) == (o.color, o.shape) for p in shapes) == 1]
    if uniq_pair:
        o = _pick(rng, uniq_pair)
        qs.append(Question("where", TEMPLATES["where"].format(color=o.color, shape=o.shape), o.quadrant, [o.box]))
    qs.append(Question("read", TEMPLATES["read"], number, [number_box]))
    return qs


def generate_image_sample(seed: int, index: int, cfg: ShapesConfig | None = None) -> ImageSample:
    """Deterministic sample ``index`` of the stream ``seed`` (same arguments -> identical pixels and questions)."""
    cfg = cfg or ShapesConfig()
    img, objects, number, number_box, count_shape, rng = render_scene(seed, index, cfg)
    qs = make_questions(rng, objects, number, number_box, count_shape, cfg)
    return ImageSample(img, objects, number, number_box, qs, seed, index)


def make_split(split: str, n: int, cfg: ShapesConfig | None = None, offset: int = 0) -> list[ImageSample]:
    """``n`` image samples of ``split`` (train/val/test/calib); splits use disjoint seed streams."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(SPLIT_SEEDS)}, got {split!r}")
    return [generate_image_sample(SPLIT_SEEDS[split], offset + i, cfg) for i in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Evidence tokens
# ----------------------------------------------------------------------------------------------------------
def evidence_mask(
    boxes: list[Box], image_size: int | tuple[int, int], grid_h: int, grid_w: int, min_cover: float = 0.25
) -> np.ndarray:
    """Bool mask ``(grid_h*grid_w,)`` in row-major patch order: patches covered >= ``min_cover`` by the boxes.

    ``image_size`` is ``S`` or ``(width, height)``. If boxes are given but no patch reaches ``min_cover``,
    the single best-covered patch is marked, so a non-empty evidence set stays non-empty.
    """
    w, h = (image_size, image_size) if isinstance(image_size, int) else image_size
    raster = np.zeros((h, w), dtype=np.float32)
    for x0, y0, x1, y1 in boxes:
        raster[max(0, int(y0)):min(h, int(y1)), max(0, int(x0)):min(w, int(x1))] = 1.0
    ys = np.linspace(0, h, grid_h + 1).round().astype(int)
    xs = np.linspace(0, w, grid_w + 1).round().astype(int)
    cover = np.add.reduceat(np.add.reduceat(raster, ys[:-1], axis=0), xs[:-1], axis=1)
    cover /= np.outer(np.diff(ys), np.diff(xs))
    mask = (cover >= min_cover).reshape(-1)
    if boxes and not mask.any() and cover.max() > 0:
        mask[int(cover.argmax())] = True
    return mask


# ----------------------------------------------------------------------------------------------------------
# Files on disk
# ----------------------------------------------------------------------------------------------------------
def write_split(out_dir: str | Path, split: str, n: int, cfg: ShapesConfig | None = None) -> Path:
    """Write ``n`` PNGs of ``split`` and ``questions.jsonl`` (id, image, question, answer, qtype, boxes)."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    path = out / "questions.jsonl"
    with path.open("w") as f:
        for s in make_split(split, n, cfg):
            name = f"images/{split}_{s.index:05d}.png"
            s.image.save(out / name)
            for k, q in enumerate(s.questions):
                row = {"id": f"{split}_{s.index:05d}_{k}", "image": name, "question": q.text,
                       "answer": q.answer, "qtype": q.qtype, "boxes": [list(b) for b in q.boxes]}
                f.write(json.dumps(row) + "\n")
    return path

