"""Video input: frame-accurate uniform sampling (decord, PyAV fallback) and model inputs built from frames.

Reading
-------
:func:`load_video` samples ``N`` frames at indices ``round(linspace(0, T - 1, N))`` (the rule GridProbe uses
for its candidates) and keeps each frame's source index and timestamp. decord 0.6 seeks frame-accurately;
when decord is missing or cannot open the file, PyAV decodes the stream sequentially and keeps the wanted
indices (also frame-accurate, slower on long videos). Decoding is bounded (:mod:`vtprune.media.video_io`): sources
above 33.5 MP per frame are refused, at most 256 frames are sampled, each scaled inside the decoder to at most
1 MP; rotated clips come out upright (read with PyAV). Errors are ``FileNotFoundError`` (no file),
:class:`~vtprune.errors.UserError` (a folder, an empty file, a limit exceeded) or ``ValueError`` (undecodable
data, no video stream, zero-length stream).

Odd resolutions: decoders return odd-sized frames as stored and every processor resizes them, so they are
used as is. Frames whose short side is below ``MIN_SIDE`` (28 px, one merged Qwen patch) are upscaled
(bicubic, aspect kept); aspect ratios above ``MAX_ASPECT`` (200, Qwen's ``smart_resize`` limit) are refused.

Model inputs (the "route")
--------------------------
``route="video"`` is the model's own video path: ``processor(videos=[frames])`` gives ``pixel_values_videos``
and video placeholder tokens (Qwen2/2.5-VL: two frames per temporal patch). In transformers 5.24 every video
processor subclasses ``BaseVideoProcessor``, which requires torchvision (no PIL/numpy video backend exists, and
``Qwen2VLImageProcessorPil`` only patches single images, duplicating each one over the temporal patch), so
without torchvision the processor has no ``video_processor`` and ``route="auto"`` falls back to
``route="images"``: the frames go through the image processor as consecutive images (one placeholder block
per frame), the multi-image route of the GridProbe paper. Nothing of the processor is re-implemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vtprune.errors import UserError, install_extra
from vtprune.media.video_io import (
    StreamInfo,
    check_frame_count,
    count_frames,
    decode_pyav,
    decode_size,
    frame_pixel_cap,
    probe,
    read_decord,
    uniform_indices,
)
from vtprune.models.tiny import prompt_for

MIN_SIDE = 28
MAX_ASPECT = 200.0
ROUTES = ("auto", "video", "images")


@dataclass
class VideoClip:
    """Sampled frames of a video.

    frames: RGB PIL images, in time order; indices: their frame numbers in the source; times: their
    presentation times in seconds; fps / total_frames / duration describe the source stream.
    """

    frames: list[Image.Image]
    indices: list[int]
    times: list[float]
    fps: float
    total_frames: int
    duration: float
    backend: str = "memory"
    path: str | None = None
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.frames)

    def subset(self, positions: list[int]) -> VideoClip:
        """The clip restricted to ``positions`` (indices into ``frames``), same source metadata."""
        return VideoClip([self.frames[i] for i in positions], [self.indices[i] for i in positions],
                         [self.times[i] for i in positions], self.fps, self.total_frames, self.duration,
                         self.backend, self.path, list(self.notes))


class ZeroLengthError(ValueError):
    """The file holds a video stream without any decodable frame (or no video stream at all)."""


def clip_from_frames(frames: list[Image.Image] | np.ndarray, fps: float = 1.0) -> VideoClip:
    """A :class:`VideoClip` from in-memory frames (PIL images or a ``[T, H, W, 3]`` uint8 array)."""
    images = [fit_frame(f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f))) for f in frames]
    if not images:
        raise ValueError("the clip has no frames; give at least one frame.")
    return VideoClip(images, list(range(len(images))), [i / fps for i in range(len(images))], fps,
                     len(images), len(images) / fps)


def load_video(path: str | Path, num_frames: int = 8, backend: str = "auto",
               max_pixels: int | None = None) -> VideoClip:
    """Read ``num_frames`` uniformly sampled frames of ``path`` with ``backend`` (``auto``/``decord``/``pyav``).

    ``auto`` tries decord and falls back to PyAV when decord is not installed or cannot read the file; clips
    with rotation metadata are read with PyAV (see :mod:`vtprune.media.video_io`). Frames are decoded at most at
    ``max_pixels`` pixels (default :data:`~vtprune.media.video_io.MAX_FRAME_PIXELS`, within the clip budget).
    Fewer frames than ``num_frames`` are returned when the video is shorter (all of its frames).
    """
    file = _check_video_file(path)
    check_frame_count(num_frames)
    if backend not in ("auto", "decord", "pyav"):
        raise ValueError(f"backend must be 'auto', 'decord' or 'pyav', got {backend!r}.")
    info = _probe(file)
    cap = frame_pixel_cap(num_frames, max_pixels)
    errors, notes = [], []
    if info.rotation:
        notes.append(f"the clip is rotated {info.rotation} degrees (display matrix): read upright with PyAV")
    elif backend in ("auto", "decord"):
        try:
            return _read_decord(file, num_frames, info, cap)
        except Exception as error:  # ImportError, RuntimeError, decord.DECORDError (an Exception subclass)
            if backend == "decord":
                raise ValueError(f"decord cannot read video {str(path)!r}: {_first_line(error)}") from error
            errors.append(f"decord: {_first_line(error)}")
    try:
        clip = _read_pyav(file, num_frames, info, cap)
    except (ZeroLengthError, UserError):
        raise
    except Exception as error:  # PyAV raises av.error.* (OSError / ValueError subclasses) and more
        errors.append(f"PyAV: {_first_line(error)}")
        raise ValueError(f"cannot decode video {str(path)!r} ({'; '.join(errors)}).") from error
    clip.notes.extend(notes + [f"decord failed, read with PyAV ({e})" for e in errors])
    return clip


def _check_video_file(path: str | Path) -> Path:
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"video {str(path)!r} does not exist.")
    if file.is_dir():
        raise UserError(f"video {str(path)!r} is a folder; give the path of one video file.")
    if file.stat().st_size == 0:
        raise UserError(f"video {str(path)!r} is empty (0 bytes).")
    return file


def _probe(file: Path) -> StreamInfo:
    """:func:`vtprune.media.video_io.probe`, its failures as ``ValueError`` ("cannot decode") or :class:`UserError`."""
    try:
        info = probe(file)
    except UserError:
        raise
    except ImportError as error:
        raise UserError(f"video input needs PyAV ({error}); {install_extra('video')}.") from error
    except Exception as error:  # av.error.* for data that is not a video
        raise ValueError(f"cannot decode video {str(file)!r} (PyAV: {_first_line(error)}).") from error
    width, height = info.display_size
    if width and height and max(width, height) / min(width, height) > MAX_ASPECT:
        raise UserError(f"video {str(file)!r} is {width}x{height}, an aspect ratio above {MAX_ASPECT:g}:1, which "
                        "vision processors refuse; crop the video first.")
    return info


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def _read_decord(file: Path, num_frames: int, info: StreamInfo, max_pixels: int) -> VideoClip:
    size = decode_size(*info.display_size, max_pixels) if info.width else (-1, -1)
    frames, indices, times, fps, total = read_decord(file, num_frames, size)
    duration = total / fps if fps > 0 else (times[-1] if times else 0.0)
    return VideoClip([fit_frame(f) for f in frames], indices, times, fps, total, duration, "decord", str(file))


def _read_pyav(file: Path, num_frames: int, info: StreamInfo, max_pixels: int) -> VideoClip:
    if not info.width and not info.frames:
        raise ZeroLengthError(f"video {str(file)!r} has no video stream.")
    total = info.frames or count_frames(file)
    decoded = decode_pyav(file, uniform_indices(total, num_frames), info.fps, max_pixels)
    if decoded is None:  # the container's frame count was wrong: count by decoding, then sample again
        total = count_frames(file)
        decoded = decode_pyav(file, uniform_indices(total, num_frames), info.fps, max_pixels)
    if decoded is None or not decoded[0]:
        raise ZeroLengthError(f"video {str(file)!r} has a video stream without decodable frames (zero length).")
    frames, times = decoded
    duration = total / info.fps if info.fps > 0 else times[-1]
    return VideoClip([fit_frame(f) for f in frames], uniform_indices(total, num_frames), times, info.fps, total,
                     duration, "pyav", str(file))


def fit_frame(frame: Image.Image, min_side: int = MIN_SIDE, max_aspect: float = MAX_ASPECT) -> Image.Image:
    """RGB ``frame``, upscaled so its short side is at least ``min_side``; refuses extreme aspect ratios."""
    frame = frame.convert("RGB")
    width, height = frame.size
    if min(width, height) < 1 or max(width, height) / min(width, height) > max_aspect:
        raise ValueError(f"frame size {width}x{height} has an aspect ratio above {max_aspect:g}:1, which "
                         "vision processors refuse; crop the video first.")
    if min(width, height) < min_side:
        scale = min_side / min(width, height)
        frame = frame.resize((math.ceil(width * scale), math.ceil(height * scale)), Image.BICUBIC)
    return frame


def downscale(frame: Image.Image, max_pixels: int | None) -> Image.Image:
    """``frame`` shrunk (aspect kept) to at most ``max_pixels`` pixels, sides at least ``MIN_SIDE``; None: as is."""
    width, height = frame.size
    if not max_pixels or width * height <= max_pixels:
        return frame
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(MIN_SIDE, int(width * scale)), max(MIN_SIDE, int(height * scale)))
    return frame.resize(size, Image.BICUBIC)


# -- model inputs from frames ---------------------------------------------------------------------------------
def video_route(processor: Any, route: str = "auto") -> str:
    """``"video"`` when the processor has a video processor (the model's own video path), else ``"images"``."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}.")
    has_video = getattr(processor, "video_processor", None) is not None
    if route == "video" and not has_video:
        raise ValueError(
            "route='video' needs the processor's video processor; transformers' video processors require "
            "torchvision, which is not installed. Use route='images' (frames as consecutive images)."
        )
    if route == "auto":
        return "video" if has_video else "images"
    return route


def frame_prompts(processor: Any, model_type: str, questions: list[str], counts: list[int], route: str) -> list[str]:
    """Prompt texts with one image placeholder per frame (``images``) or one video placeholder (``video``)."""
    texts = []
    for question, count in zip(questions, counts, strict=True):
        visual = [{"type": "video"}] if route == "video" else [{"type": "image"}] * count
        if getattr(processor, "chat_template", None):
            messages = [{"role": "user", "content": [*visual, {"type": "text", "text": question}]}]
            texts.append(processor.apply_chat_template(messages, add_generation_prompt=True))
            continue
        text = prompt_for(model_type, question, images=1 if route == "video" else count)
        if route == "video":
            image_token = getattr(processor, "image_token", "<image>")
            text = text.replace(image_token, getattr(processor, "video_token", "<video>"), 1)
        texts.append(text)
    return texts


def frame_inputs(processor: Any, model_type: str, frame_lists: list[list[Image.Image]], questions: list[str],
                 route: str = "auto") -> dict:
    """Processor outputs (left padded) for one frame list per question, through the model's own processor."""
    route = video_route(processor, route)
    texts = frame_prompts(processor, model_type, questions, [len(f) for f in frame_lists], route)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    if route == "video":
        return dict(processor(text=texts, videos=[list(f) for f in frame_lists], return_tensors="pt", padding=True))
    images = [frame for frames in frame_lists for frame in frames]
    return dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
