"""Video input: frame-accurate uniform sampling (decord, PyAV fallback) and model inputs built from frames.

Reading
-------
:func:`load_video` samples ``N`` frames at indices ``round(linspace(0, T - 1, N))`` (the rule GridProbe uses
for its candidates) and keeps each frame's source index and timestamp. decord 0.6 seeks frame-accurately;
when decord is missing or cannot open the file, PyAV decodes the stream sequentially and keeps the wanted
indices (also frame-accurate, slower on long videos). Errors are ``FileNotFoundError`` (no file) or
``ValueError`` (empty file, undecodable data, no video stream, zero-length stream).

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


def uniform_indices(total: int, n: int) -> list[int]:
    """``round(linspace(0, total - 1, n))`` without duplicates; all frames when ``n >= total``."""
    if total <= 0:
        return []
    if n >= total:
        return list(range(total))
    if n <= 1:
        return [0]
    return sorted({int(i) for i in np.round(np.linspace(0, total - 1, n))})


def clip_from_frames(frames: list[Image.Image] | np.ndarray, fps: float = 1.0) -> VideoClip:
    """A :class:`VideoClip` from in-memory frames (PIL images or a ``[T, H, W, 3]`` uint8 array)."""
    images = [fit_frame(f if isinstance(f, Image.Image) else Image.fromarray(np.asarray(f))) for f in frames]
    if not images:
        raise ValueError("the clip has no frames; give at least one frame.")
    return VideoClip(images, list(range(len(images))), [i / fps for i in range(len(images))], fps,
                     len(images), len(images) / fps)


def load_video(path: str | Path, num_frames: int = 8, backend: str = "auto") -> VideoClip:
    """Read ``num_frames`` uniformly sampled frames of ``path`` with ``backend`` (``auto``/``decord``/``pyav``).

    ``auto`` tries decord and falls back to PyAV when decord is not installed or cannot read the file.
    Fewer frames than ``num_frames`` are returned when the video is shorter (all of its frames).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"video {str(path)!r} does not exist.")
    if file.stat().st_size == 0:
        raise ValueError(f"video {str(path)!r} is empty (0 bytes).")
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}.")
    if backend not in ("auto", "decord", "pyav"):
        raise ValueError(f"backend must be 'auto', 'decord' or 'pyav', got {backend!r}.")
    errors = []
    if backend in ("auto", "decord"):
        try:
            return _read_decord(file, num_frames)
        except Exception as error:  # ImportError, RuntimeError, decord.DECORDError (an Exception subclass)
            if backend == "decord":
                raise ValueError(f"decord cannot read video {str(path)!r}: {_first_line(error)}") from error
            errors.append(f"decord: {_first_line(error)}")
    try:
        clip = _read_pyav(file, num_frames)
    except ZeroLengthError:
        raise
    except Exception as error:  # PyAV raises av.error.* (OSError / ValueError subclasses) and more
        errors.append(f"PyAV: {_first_line(error)}")
        raise ValueError(f"cannot decode video {str(path)!r} ({'; '.join(errors)}).") from error
    clip.notes.extend(f"decord failed, read with PyAV ({e})" for e in errors)
    return clip


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def _read_decord(file: Path, num_frames: int) -> VideoClip:
    import decord

    reader = decord.VideoReader(str(file), ctx=decord.cpu(0))
    total = len(reader)
    if total == 0:
        raise ValueError("decord found no frames")
    indices = uniform_indices(total, num_frames)
    batch = reader.get_batch(indices).asnumpy()
    times = [float(t) for t in reader.get_frame_timestamp(indices)[:, 0]]
    fps = float(reader.get_avg_fps() or 0.0)
    duration = total / fps if fps > 0 else (times[-1] if times else 0.0)
    frames = [fit_frame(Image.fromarray(frame)) for frame in batch]
    return VideoClip(frames, indices, times, fps, total, duration, "decord", str(file))


def _read_pyav(file: Path, num_frames: int) -> VideoClip:
    import av

    with av.open(str(file)) as container:
        if not container.streams.video:
            raise ZeroLengthError(f"video {str(file)!r} has no video stream.")
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 0.0)
        claimed = int(stream.frames or 0)
    total = claimed or _count_frames(file)
    clip = _decode_indices(file, uniform_indices(total, num_frames), fps)
    if clip is None:  # the container's frame count was wrong: count by decoding, then sample again
        total = _count_frames(file)
        clip = _decode_indices(file, uniform_indices(total, num_frames), fps)
    if clip is None or not clip.frames:
        raise ZeroLengthError(f"video {str(file)!r} has a video stream without decodable frames (zero length).")
    clip.total_frames = total
    clip.duration = total / fps if fps > 0 else clip.times[-1]
    return clip


def _count_frames(file: Path) -> int:
    import av

    with av.open(str(file)) as container:
        return sum(1 for _ in container.decode(video=0))


def _decode_indices(file: Path, indices: list[int], fps: float) -> VideoClip | None:
    """Decode sequentially, keeping ``indices``; None if the stream ends before the last wanted frame."""
    import av

    wanted, frames, times = set(indices), [], []
    if not wanted:
        return None
    last = max(wanted)
    with av.open(str(file)) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number in wanted:
                frames.append(fit_frame(frame.to_image().convert("RGB")))
                times.append(float(frame.time) if frame.time is not None else number / max(fps, 1e-9))
            if number >= last:
                break
    if len(frames) < len(indices):
        return None
    return VideoClip(frames, list(indices), times, fps, 0, 0.0, "pyav", str(file))


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
    from vtprune.testing import prompt_for

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
