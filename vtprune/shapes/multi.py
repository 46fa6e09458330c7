"""Multi-image prompts of vtprune-shapes: 2-8 images in one prompt, the answer in exactly one of them.

Each image has its own textured background and 2-3 distractor shapes; one target object, whose shape and
colour appear nowhere else in the set, sits in exactly one image (``MultiSample.target``). The questions use
the single-image templates the embedded models answer (``What color is the {shape}?``, ``What shape is the
{color} object?``, ``Where is the {color} {shape}?``): since the target is unique over the set, only the
target image holds the evidence. The ordinal form ("In the third image, what color is the circle?") is not
used: neither embedded model knows ordinal words (their vocabularies are the task's words only), and
teaching them would need a new training run. ``Question.frames`` is ``[target]`` and ``Question.boxes`` the
target's box in that image, so :func:`vtprune.shapes.task.evidence_mask` gives the evidence tokens of that
image's grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from vtprune.shapes import task as S
from vtprune.shapes.video import _draw_all

MULTI_QTYPES: tuple[str, ...] = ("color", "shape", "where")
MULTI_SEED_OFFSET = 31  # the multi-image streams are disjoint from the image (no offset) and video (17) ones


@dataclass
class MultiSample:
    """``images`` of one prompt, the ``target`` image holding the answer, and one question per type."""

    images: list[Image.Image]
    target: int
    questions: list[S.Question]
    seed: int
    index: int


def generate_multi_sample(seed: int, index: int, n_images: int, cfg: S.ShapesConfig | None = None,
                          target: int | None = None) -> MultiSample:
    """Deterministic set ``index`` of stream ``seed`` with ``n_images`` images; the target in image ``target``.

    ``target`` None draws it uniformly. Distractors take the other three shapes and the other five colours,
    so the target's shape and colour are unique in the set.
    """
    if n_images < 1:
        raise ValueError(f"n_images must be >= 1, got {n_images}")
    cfg = cfg or S.ShapesConfig()
    rng = np.random.default_rng([int(seed), int(index), int(n_images), MULTI_SEED_OFFSET])
    size = cfg.image_size
    target_shape = S.SHAPES[int(rng.integers(len(S.SHAPES)))]
    colors = [str(c) for c in rng.permutation(S.COLORS)]
    target_color, distractor_colors = colors[0], colors[1:]
    other_shapes = [s for s in S.SHAPES if s != target_shape]
    where = int(rng.integers(n_images)) if target is None else int(target)
    if not 0 <= where < n_images:
        raise ValueError(f"target must be in [0, {n_images}), got {target}")
    images, target_box = [], None
    for i in range(n_images):
        base = S._background(rng, size, cfg)
        taken: list[S.Box] = []
        items: list[tuple[str, S.Box, tuple[int, int, int]]] = []
        for color in rng.permutation(distractor_colors)[: int(rng.integers(2, 4))]:
            side = int(round(size * rng.uniform(*cfg.object_frac)))
            box = S._place(rng, side, side, size, taken)
            if box is not None:
                taken.append(box)
                shape = str(other_shapes[int(rng.integers(len(other_shapes)))])
                items.append((shape, box, S._jitter(rng, S.PALETTE[str(color)], cfg.color_jitter)))
        if i == where:
            side = int(round(size * rng.uniform(*cfg.object_frac)))
            target_box = S._place(rng, side, side, size, taken)
            assert target_box is not None, "target must fit"
            items.append((target_shape, target_box, S._jitter(rng, S.PALETTE[target_color], cfg.color_jitter)))
        frame = _draw_all(base, items)
        noise = rng.normal(0, cfg.noise_sigma / 2, size=(size, size, 3))
        images.append(Image.fromarray(np.clip(np.asarray(frame, np.float32) + noise, 0, 255).astype(np.uint8), "RGB"))
    quadrant = S._quadrant_of(target_box, size)
    questions = [
        S.Question("color", S.TEMPLATES["color"].format(shape=target_shape), target_color, [target_box], [where]),
        S.Question("shape", S.TEMPLATES["shape"].format(color=target_color), target_shape, [target_box], [where]),
        S.Question("where", S.TEMPLATES["where"].format(color=target_color, shape=target_shape), quadrant,
                   [target_box], [where]),
    ]
    return MultiSample(images, where, questions, seed, index)


def make_multi_split(split: str, n: int, n_images: int, cfg: S.ShapesConfig | None = None) -> list[MultiSample]:
    """``n`` sets of ``n_images`` images of ``split`` (seed streams disjoint from the image and video ones)."""
    if split not in S.SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(S.SPLIT_SEEDS)}, got {split!r}")
    return [generate_multi_sample(S.SPLIT_SEEDS[split], i, n_images, cfg) for i in range(n)]
