"""Uploads of the Gradio demo: where they may come from, their size, kind and content (no Gradio here).

:func:`check_upload` returns ``"image"`` or ``"video"`` for an acceptable file and raises :class:`UploadError`
(shown in the page as is) otherwise: outside the upload folder, empty, too large, an unknown suffix, an image
that is not readable (empty, truncated, over 16.8 MP, extreme aspect), a file with a video suffix that holds
no decodable video stream. :func:`load_image` reads an accepted image like the rest of vtprune (EXIF
orientation applied, 16-bit scaled).
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from vtprune.errors import UserError
from vtprune.media.images import MAX_ASPECT, MAX_IMAGE_PIXELS, open_image
from vtprune.media.video_io import probe

MAX_UPLOAD_MB = 50
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".avi", ".mkv", ".m4v")


class UploadError(ValueError):
    """An upload the demo refuses; the message is shown to the user as is."""


def check_upload(path: str | Path, roots: list[str | Path], max_mb: float = MAX_UPLOAD_MB) -> str:
    """``"image"`` or ``"video"`` for an acceptable upload under one of ``roots``, else :class:`UploadError`.

    The path is resolved (symlinks followed) and must lie inside an allowed folder, so a client cannot make
    the demo read any other file; then size, suffix and content are checked.
    """
    file = Path(path).resolve()
    if not any(file.is_relative_to(Path(root).resolve()) for root in roots):
        raise UploadError("this file is not in the demo's upload folder; upload it through the page.")
    if not file.is_file():
        raise UploadError("the uploaded file is gone; upload it again.")
    size_mb = file.stat().st_size / 2**20
    if file.stat().st_size == 0:
        raise UploadError(f"{file.name} is empty (0 bytes); upload the file again.")
    if size_mb > max_mb:
        raise UploadError(f"{file.name} is {size_mb:.1f} MB; the demo accepts files up to {max_mb:g} MB.")
    suffix = file.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        _check_image(file)
        return "image"
    if suffix in VIDEO_SUFFIXES:
        _check_video(file)
        return "video"
    raise UploadError(f"{file.name} is not an image or a video; upload a picture "
                      f"({', '.join(s[1:] for s in IMAGE_SUFFIXES[:4])}, ...) or a video "
                      f"({', '.join(s[1:] for s in VIDEO_SUFFIXES[:3])}, ...).")


def _check_image(file: Path) -> None:
    try:
        with Image.open(file) as image:
            width, height = image.size
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise UploadError(f"{file.name} is not a readable image ({type(error).__name__}).") from error
    if width * height > MAX_IMAGE_PIXELS:
        raise UploadError(f"{file.name} is {width}x{height} pixels; the demo accepts up to "
                          f"{MAX_IMAGE_PIXELS / 1e6:.1f} megapixels.")
    try:
        open_image(file, max_aspect=MAX_ASPECT)  # decodes every pixel: a truncated file fails here, not later
    except UserError as error:
        reason = str(error).replace(f"image {str(file)!r}", file.name, 1)
        if "aspect ratio" not in reason:
            reason = f"{file.name} is not a readable image (truncated or corrupt)."
        raise UploadError(reason) from error


def _check_video(file: Path) -> None:
    """A file with a video suffix must hold a decodable video stream within the decoding limits."""
    try:
        info = probe(file)
    except UserError as error:
        raise UploadError(str(error).replace(repr(str(file)), file.name)) from error
    except ImportError:
        return
    except Exception as error:  # av.error.* (not a video container)
        raise UploadError(f"{file.name} is not a readable video (its data is not a video container).") from error
    if not info.width:
        raise UploadError(f"{file.name} holds no video stream; upload a video (mp4, webm, mov, ...).")


def load_image(path: str | Path) -> Image.Image:
    """The (already checked) image file as upright 8-bit RGB (EXIF orientation applied, 16-bit scaled)."""
    return open_image(path)
