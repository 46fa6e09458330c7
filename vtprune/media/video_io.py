"""Bounded video decoding: probe the stream, then decode only the sampled frames, resized inside the decoder.

Limits (documented in ``docs/video.md``):

* a source frame above :data:`MAX_SOURCE_PIXELS` (8K UHD fits) is refused before any frame is decoded;
* at most :data:`MAX_FRAMES` frames are sampled;
* each sampled frame is scaled by the decoder (decord's ``width``/``height``, PyAV's ``reformat``) to at most
  ``min(MAX_FRAME_PIXELS, MAX_CLIP_PIXELS // frames)`` pixels, aspect ratio kept, so no full-resolution
  RGB frame (nor a stack of them) is ever materialised.

Rotation: a clip's display matrix (phone videos, ``ffmpeg -display_rotation``) is applied, so frames come
out upright as a player shows them. PyAV reports it per frame (``VideoFrame.rotation``) and the frame is
turned here; decord 0.6 mishandles rotated clips (4-channel buffers, failed batch reads, frames squashed
into the stored size), so rotated clips are always read with PyAV and both backends give the same frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vtprune.errors import UserError

MAX_SOURCE_PIXELS = 8192 * 4096
MAX_FRAMES = 256
MAX_FRAME_PIXELS = 1024 * 1024
MAX_CLIP_PIXELS = 64 * 1024 * 1024
TURNS = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}


@dataclass
class StreamInfo:
    """The first video stream of a file: stored size, rotation (degrees counter-clockwise), rate, frame count."""

    width: int
    height: int
    rotation: int
    fps: float
    frames: int

    @property
    def display_size(self) -> tuple[int, int]:
        """``(width, height)`` as a player shows the frames (after the rotation)."""
        return (self.height, self.width) if self.rotation in (90, 270) else (self.width, self.height)


def check_frame_count(num_frames: int) -> None:
    """Refuse a frame count outside ``1..MAX_FRAMES``."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or not 1 <= num_frames <= MAX_FRAMES:
        raise UserError(f"num_frames (--frames) must be an integer in 1..{MAX_FRAMES}, got {num_frames!r}; "
                        "e.g. --frames 8.")


def frame_pixel_cap(num_frames: int, max_pixels: int | None = None) -> int:
    """Pixels per decoded frame: ``max_pixels`` (default :data:`MAX_FRAME_PIXELS`), within the clip budget."""
    cap = MAX_FRAME_PIXELS if max_pixels is None else int(max_pixels)
    return max(1, min(cap, MAX_CLIP_PIXELS // max(1, num_frames)))


def decode_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """``(width, height)`` scaled down (aspect kept, even sides for the scaler) to at most ``max_pixels``."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def probe(file: Path) -> StreamInfo:
    """The stream's size, rotation, rate and claimed frame count (PyAV; only the first frame is decoded).

    Raises :class:`UserError` for a source above :data:`MAX_SOURCE_PIXELS` before decoding anything.
    """
    import av

    with av.open(str(file)) as container:
        if not container.streams.video:
            return StreamInfo(0, 0, 0, 0.0, 0)
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        check_source_size(width, height, file)
        fps = float(stream.average_rate or 0.0)
        frames = int(stream.frames or 0)
        first = next(container.decode(video=0), None)
        rotation = _rotation(first) if first is not None else 0
        if first is not None:
            width, height = first.width, first.height
    check_source_size(width, height, file)
    return StreamInfo(width, height, rotation, fps, frames)


def check_source_size(width: int, height: int, file: Path) -> None:
    """Refuse frames above :data:`MAX_SOURCE_PIXELS` (decoding one would already take hundreds of MB)."""
    if width * height > MAX_SOURCE_PIXELS:
        raise UserError(f"video {str(file)!r} is {width}x{height} per frame ({width * height / 1e6:.1f} MP); vtprune "
                        f"decodes videos up to {MAX_SOURCE_PIXELS / 1e6:.1f} MP per frame (8K UHD). Downscale it "
                        "first, e.g. ffmpeg -i IN -vf scale=1920:-2 OUT.mp4.")


def _rotation(frame: object) -> int:
    """Counter-clockwise display rotation of a PyAV frame, normalised to 0 / 90 / 180 / 270."""
    try:
        degrees = float(getattr(frame, "rotation", 0) or 0)
    except (TypeError, ValueError):
        return 0
    return int(round(degrees / 90.0)) % 4 * 90


def upright(image: Image.Image, rotation: int) -> Image.Image:
    """``image`` turned by its display rotation (counter-clockwise degrees)."""
    return image.transpose(TURNS[rotation]) if rotation in TURNS else image


def uniform_indices(total: int, n: int) -> list[int]:
    """``round(linspace(0, total - 1, n))`` without duplicates; all frames when ``n >= total``."""
    if total <= 0:
        return []
    if n >= total:
        return list(range(total))
    if n <= 1:
        return [0]
    return sorted({int(i) for i in np.round(np.linspace(0, total - 1, n))})


def read_decord(file: Path, num_frames: int, size: tuple[int, int]
                ) -> tuple[list[Image.Image], list[int], list[float], float, int]:
    """``num_frames`` uniform frames scaled by decord to ``size``: frames, indices, times, fps, frame count."""
    import decord

    reader = decord.VideoReader(str(file), ctx=decord.cpu(0), width=size[0], height=size[1])
    total = len(reader)
    if total == 0:
        raise ValueError("decord found no frames")
    indices = uniform_indices(total, num_frames)
    batch = reader.get_batch(indices).asnumpy()
    times = [float(t) for t in reader.get_frame_timestamp(indices)[:, 0]]
    frames = [Image.fromarray(frame) for frame in batch]
    return frames, indices, times, float(reader.get_avg_fps() or 0.0), total


def decode_pyav(file: Path, indices: list[int], fps: float, max_pixels: int
                ) -> tuple[list[Image.Image], list[float]] | None:
    """Decode sequentially, keeping ``indices`` scaled in the decoder and turned upright; None if the stream
    ends before the last wanted frame."""
    import av

    wanted, frames, times = set(indices), [], []
    if not wanted:
        return None
    last = max(wanted)
    with av.open(str(file)) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number in wanted:
                width, height = decode_size(frame.width, frame.height, max_pixels)
                small = frame.reformat(width=width, height=height, format="rgb24", interpolation="AREA")
                frames.append(upright(small.to_image(), _rotation(frame)))
                times.append(float(frame.time) if frame.time is not None else number / max(fps, 1e-9))
            if number >= last:
                break
    if len(frames) < len(indices):
        return None
    return frames, times


def count_frames(file: Path) -> int:
    """Decodable frames of the first video stream (decoded one at a time and dropped, never converted)."""
    import av

    with av.open(str(file)) as container:
        return sum(1 for _ in container.decode(video=0))
