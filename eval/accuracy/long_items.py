"""Questions over long visual contexts and their token-level evidence, for ``vtprune.eval.accuracy.long``.

Two settings, both on vtprune-shapes with the embedded models (16 visual tokens per 112 px image):

* ``video``: every frame of a clip of the video split (16-32 frames, or a fixed length with ``frames=``),
  as consecutive images (the ``images`` route), asked open-ended (``shapes_video.open_form``: the answer is
  a colour or shape word); the target is visible in 2-4 consecutive frames.
* ``multi``: 2-8 different images in one prompt (``shapes_multi``), the target in exactly one of them.

Evidence is token-level: each evidence frame's visual tokens are mapped to its patch grid (the adapter's
segment ``h x w``, one segment per image) and the tokens covered by the target's box are marked, as the image
benchmark does for a single image (:func:`vtprune.shapes.task.evidence_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

SETTINGS = ("video", "multi")


@dataclass
class LongItem:
    """One question over ``frames`` (images of one prompt); ``evidence`` lists the frames that show the answer."""

    frames: list[Image.Image]
    question: str
    answer: str
    qtype: str
    evidence: list[int]
    boxes: list = field(default_factory=list)
    group: str = ""  # e.g. "16-32 frames" or "8 images": the context length the row belongs to


def video_items(split: str, clips: int, frames: int | None = None) -> list[LongItem]:
    """Both open-ended questions of the first ``clips`` clips; ``frames`` fixes the clip length (default 16-32)."""
    from vtprune.shapes.task import ShapesConfig
    from vtprune.shapes.video import make_video_split, open_form

    cfg = ShapesConfig(video_frames=(frames, frames)) if frames else ShapesConfig()
    group = f"{frames} frames" if frames else "16-32 frames"
    items = []
    for clip in make_video_split(split, clips, cfg):
        for q in clip.questions:
            text, word = open_form(q)
            items.append(LongItem(clip.frames, text, word, q.qtype, list(q.frames), list(q.boxes), group))
    return items


def multi_items(split: str, sets: int, n_images: int) -> list[LongItem]:
    """Every question of the first ``sets`` sets of ``n_images`` images (``shapes_multi``)."""
    from vtprune.shapes.multi import make_multi_split

    group = f"{n_images} images"
    return [LongItem(s.images, q.text, q.answer, q.qtype, list(q.frames), list(q.boxes), group)
            for s in make_multi_split(split, sets, n_images) for q in s.questions]


def frame_segments(segments: list, n_frames: int) -> list:
    """The segments of one sample, checked to be one ``t = 1`` grid per frame (the images route)."""
    if len(segments) != n_frames or any(s.t != 1 for s in segments):
        raise ValueError(f"expected one image segment per frame ({n_frames}), got "
                         f"{[(s.t, s.h, s.w) for s in segments]}: token evidence needs the images route.")
    return segments


def evidence_tokens(item: LongItem, segments: list, total: int) -> torch.Tensor:
    """``[total]`` float, 1.0 on the visual tokens of the evidence frames that the target's box covers.

    A frame's tokens are its segment's ``h x w`` grid in raster order (extra tokens, such as a CLS token,
    come first in the segment and are never evidence).
    """
    from vtprune.shapes.task import evidence_mask

    weights = torch.zeros(total)
    for frame in item.evidence:
        segment = frame_segments(segments, len(item.frames))[frame]
        mask = evidence_mask(item.boxes, item.frames[frame].size, segment.h, segment.w)
        start = segment.start + segment.extra
        weights[start:start + mask.size] = torch.from_numpy(mask.astype(np.float32))
    return weights


def token_frames(segments: list, total: int) -> torch.Tensor:
    """``[total]`` long: the frame (image) of each visual token."""
    ids = torch.full((total,), -1, dtype=torch.long)
    for frame, segment in enumerate(segments):
        ids[segment.start:segment.start + segment.length] = frame
    return ids


def recall_metrics(evidence: torch.Tensor, kept: list[int] | None, frames: torch.Tensor) -> dict[str, float]:
    """Token-level recall of one answer pass.

    ``recall``: the fraction of the evidence tokens (over every evidence frame) that survived; ``hit``: 1 when
    at least one did; ``best_frame``: the largest fraction of one evidence frame's target tokens that survived
    (1 when the target is whole in some frame, which is enough to answer). ``kept`` None: nothing pruned.
    """
    marked = evidence.nonzero().flatten()
    if marked.numel() == 0:
        return {"recall": float("nan"), "hit": float("nan"), "best_frame": float("nan")}
    alive = torch.ones(evidence.numel(), dtype=torch.bool)
    if kept is not None:
        alive = torch.zeros(evidence.numel(), dtype=torch.bool)
        alive[torch.as_tensor(kept, dtype=torch.long)] = True
    survived = alive[marked]
    per_frame = [float(survived[frames[marked] == f].float().mean()) for f in frames[marked].unique().tolist()]
    return {"recall": float(survived.float().mean()), "hit": float(survived.any()), "best_frame": max(per_frame)}


def calibration_prompts(n: int, video: bool = False, images_per_prompt: int = 0, frames: int | None = None
                        ) -> list[tuple[list[Image.Image], str]]:
    """``n`` long calibration prompts of the ``calib`` split, as ``(images, question)`` pairs.

    ``video``: all frames of a clip (16-32, or ``frames``) with one of its open-ended questions;
    ``images_per_prompt``: that many images (``shapes_multi``) with one of their questions.
    """
    if video:
        items = video_items("calib", (n + 1) // 2, frames)
    elif images_per_prompt:
        items = multi_items("calib", (n + 2) // 3, images_per_prompt)
    else:
        raise ValueError("calibration_prompts needs video=True or images_per_prompt >= 1")
    return [(item.frames, item.question) for item in items[:n]]
