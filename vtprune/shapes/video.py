"""Video split of vtprune-shapes: clips where the answering object is visible in only a few frames.

Each clip has 16-32 frames over one textured background with a few static distractor shapes. The target
object (its shape, or its colour, unique in the clip) appears in 2-4 consecutive frames only. Questions are
multiple choice with options A-D and end with "Answer with the letter."; ``Question.frames`` lists the
evidence frames and ``Question.boxes`` the target's box in those frames. Public entry:
:func:`generate_video_sample`.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from vtprune.shapes import task as S


def _options(rng: np.random.Generator, answer: str, pool: tuple[str, ...]) -> tuple[list[str], str]:
    """Four shuffled options containing ``answer``; returns (options, correct letter)."""
    others = [p for p in pool if p != answer]
    opts = [answer] + [str(o) for o in rng.permutation(others)[:3]]
    opts = [opts[i] for i in rng.permutation(4)]
    return opts, S.OPTION_LETTERS[opts.index(answer)]


def _mc_text(question: str, options: list[str]) -> str:
    listed = " ".join(f"{letter}. {o}" for letter, o in zip(S.OPTION_LETTERS, options, strict=True))
    return f"{question} {listed} {S.VIDEO_SUFFIX}"


def _draw_all(base: Image.Image, items: list[tuple[str, S.Box, tuple[int, int, int]]]) -> Image.Image:
    frame = base.copy()
    draw = ImageDraw.Draw(frame)
    for shape, box, rgb in items:
        S._draw_shape(draw, shape, box, rgb)
    return frame


def generate_video_sample(seed: int, index: int, cfg: S.ShapesConfig | None = None) -> S.VideoSample:
    """Deterministic clip ``index`` of stream ``seed`` with one "color" and one "shape" multiple-choice question."""
    cfg = cfg or S.ShapesConfig()
    rng = np.random.default_rng([int(seed), int(index), 17])
    size = cfg.image_size
    n_frames = int(rng.integers(cfg.video_frames[0], cfg.video_frames[1] + 1))
    base = S._background(rng, size, cfg)
    target_shape = S.SHAPES[int(rng.integers(len(S.SHAPES)))]
    colors = [str(c) for c in rng.permutation(S.COLORS)]
    target_color, distractor_colors = colors[0], colors[1:]
    taken: list[S.Box] = []
    static: list[tuple[str, S.Box, tuple[int, int, int]]] = []
    other_shapes = [s for s in S.SHAPES if s != target_shape]
    for k in range(int(rng.integers(2, 4))):
        side = int(round(size * rng.uniform(*cfg.object_frac)))
        box = S._place(rng, side, side, size, taken)
        if box is not None:
            taken.append(box)
            rgb = S._jitter(rng, S.PALETTE[distractor_colors[k]], cfg.color_jitter)
            static.append((str(other_shapes[int(rng.integers(len(other_shapes)))]), box, rgb))
    side = int(round(size * rng.uniform(*cfg.object_frac)))
    target_box = S._place(rng, side, side, size, taken)
    assert target_box is not None, "target must fit"
    target_rgb = S._jitter(rng, S.PALETTE[target_color], cfg.color_jitter)
    n_ev = int(rng.integers(cfg.video_evidence_frames[0], cfg.video_evidence_frames[1] + 1))
    start = int(rng.integers(0, n_frames - n_ev + 1))
    ev_frames = list(range(start, start + n_ev))
    frames = []
    for t in range(n_frames):
        items = static + ([(target_shape, target_box, target_rgb)] if t in ev_frames else [])
        frame = _draw_all(base, items)
        noise = rng.normal(0, cfg.noise_sigma / 2, size=(size, size, 3))
        arr = np.clip(np.asarray(frame, np.float32) + noise, 0, 255).astype(np.uint8)
        frames.append(Image.fromarray(arr, "RGB"))
    c_opts, c_letter = _options(rng, target_color, S.COLORS)
    s_opts, s_letter = _options(rng, target_shape, S.SHAPES)
    questions = [
        S.Question("color", _mc_text(S.VIDEO_TEMPLATES["color"].format(shape=target_shape), c_opts), c_letter,
                   [target_box], ev_frames),
        S.Question("shape", _mc_text(S.VIDEO_TEMPLATES["shape"].format(color=target_color), s_opts), s_letter,
                   [target_box], ev_frames),
    ]
    return S.VideoSample(frames, questions, seed, index)


def make_video_split(split: str, n: int, cfg: S.ShapesConfig | None = None) -> list[S.VideoSample]:
    """``n`` clips of ``split``; video streams are disjoint from each other and from the image streams."""
    if split not in S.SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(S.SPLIT_SEEDS)}, got {split!r}")
    return [generate_video_sample(S.SPLIT_SEEDS[split], i, cfg) for i in range(n)]


def open_form(question: S.Question) -> tuple[str, str]:
    """The open-ended form of a clip question: ``(question without options, answer word)``.

    ``"What color is the circle that appears in the video? A. red B. blue ... Answer with the letter."`` with
    answer ``B`` becomes ``("What color is the circle that appears in the video?", "blue")``.
    """
    head, _, rest = question.text.partition(" A. ")
    words = ("A. " + rest).replace(S.VIDEO_SUFFIX, "").split()
    options = {words[i].rstrip("."): words[i + 1] for i in range(0, len(words) - 1, 2)}
    return head.strip(), options[question.answer]
