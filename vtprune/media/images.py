"""Read user images safely: one clear error per bad file, EXIF orientation applied, 16-bit scaled to 8-bit.

:func:`open_image` is what every entry point that takes an image path uses (``vtprune run --image``, the
demo, ``vtprune calibrate --data``). It refuses, with a :class:`~vtprune.errors.UserError` naming the file
and the fix: a missing path, a folder, an empty file, data Pillow cannot identify, a truncated or corrupt
file, and images above :data:`MAX_IMAGE_PIXELS` (checked from the header, before any pixel is decoded, so a
decompression bomb costs nothing); with ``max_aspect`` (:func:`aspect_limit`: Qwen-VL's processors refuse more
than 200:1, LLaVA's do not) also an image beyond that aspect ratio. :func:`to_rgb` turns any decoded image into the 8-bit RGB picture a
person would see: the EXIF ``Orientation`` tag is applied (a phone photo stored sideways is turned upright)
and 16-bit / 32-bit greyscale is scaled to 0..255 instead of being clipped (which made it almost white).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vtprune.errors import UserError

MAX_IMAGE_PIXELS = 4096 * 4096
MAX_ASPECT = 200.0  # Qwen-VL's smart_resize limit (as for video frames)
ASPECT_LIMITED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # model types whose processor refuses beyond MAX_ASPECT


def aspect_limit(model_type: str | None) -> float | None:
    """The largest aspect ratio ``model_type``'s image processor accepts (Qwen-VL: 200), None: no limit."""
    return MAX_ASPECT if model_type in ASPECT_LIMITED else None


def open_image(path: str | Path, max_pixels: int = MAX_IMAGE_PIXELS, max_aspect: float | None = None) -> Image.Image:
    """The image at ``path`` as upright 8-bit RGB; :class:`UserError` (one line) for anything unusable.

    ``max_aspect``: refuse a longer-to-shorter side ratio above it (:func:`aspect_limit` of the model that
    will read the image; None: any aspect, as LLaVA's processors accept)."""
    file = Path(path)
    name = str(path)
    check_image_file(file, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                check_image_size(image.size, name, max_pixels, max_aspect)
                _load_strictly(image)
                return to_rgb(image)
    except UserError:
        raise
    except UnidentifiedImageError as error:
        raise UserError(f"image {name!r} is not an image file Pillow can read (format not recognised); "
                        "give a PNG, JPEG, WebP, BMP, GIF or TIFF file.") from error
    except Image.DecompressionBombError as error:  # Pillow refuses the header before our own size check
        raise UserError(f"image {name!r} declares more than {2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6:.0f} MP "
                        f"(a decompression bomb?); vtprune reads images up to {max_pixels / 1e6:.1f} MP. Downscale "
                        "it first.") from error
    except PermissionError as error:
        raise UserError(f"image {name!r} cannot be read (permission denied).") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise UserError(f"image {name!r} is truncated or corrupt ({_first_line(error)}); re-export or "
                        "re-download it.") from error


def _load_strictly(image: Image.Image) -> None:
    """Decode ``image``; a truncated file raises even where a library (lmms-eval imports set it) switched on
    Pillow's process-wide ``ImageFile.LOAD_TRUNCATED_IMAGES``, which fills the missing rows silently."""
    lenient = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        image.load()
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = lenient


def check_image_file(file: Path, name: str) -> None:
    """Refuse a missing path, a folder or an empty file before Pillow sees it."""
    if not file.exists():
        raise UserError(f"image {name!r} does not exist; check the path.")
    if file.is_dir():
        raise UserError(f"image {name!r} is a folder, not an image file; give the path of one image.")
    if file.stat().st_size == 0:
        raise UserError(f"image {name!r} is empty (0 bytes); give a non-empty image file.")


def check_image_size(size: tuple[int, int], name: str, max_pixels: int = MAX_IMAGE_PIXELS,
                     max_aspect: float | None = None) -> None:
    """Refuse an image whose header declares more than ``max_pixels`` pixels, no pixel, or an aspect ratio above
    ``max_aspect`` (None: no aspect limit)."""
    width, height = size
    if width < 1 or height < 1:
        raise UserError(f"image {name!r} has no pixels ({width}x{height}).")
    if max_aspect is not None and max(width, height) / min(width, height) > max_aspect:
        raise UserError(f"image {name!r} is {width}x{height}, an aspect ratio above {max_aspect:g}:1, which the "
                        "model's image processor refuses (Qwen-VL); crop it first.")
    if width * height > max_pixels:
        raise UserError(f"image {name!r} is {width}x{height} pixels ({width * height / 1e6:.1f} MP); vtprune reads "
                        f"images up to {max_pixels / 1e6:.1f} MP. Downscale it first (vision models resize "
                        "to far fewer pixels anyway).")


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB with the EXIF orientation applied; 16/32-bit greyscale and float images are rescaled."""
    upright = ImageOps.exif_transpose(image) or image
    if upright.mode in ("I", "F") or upright.mode.startswith("I;16"):
        upright = Image.fromarray(_to_uint8(np.asarray(upright)), "L")
    return upright.convert("RGB")


def _to_uint8(values: np.ndarray) -> np.ndarray:
    """Scale integer or float pixel values to 0..255: by the range their type and values imply."""
    data = values.astype(np.float64)
    if data.size == 0:
        return data.astype(np.uint8)
    top = float(np.nanmax(data))
    if np.issubdtype(values.dtype, np.floating):
        scale = 255.0 if top <= 1.0 else 255.0 / max(top, 255.0)
    elif values.dtype == np.uint16 or values.dtype.itemsize == 2 or 255 < top <= 65535:
        scale = 255.0 / 65535.0
    elif top <= 255:
        scale = 1.0
    else:
        scale = 255.0 / top
    return np.clip(np.nan_to_num(data * scale), 0, 255).round().astype(np.uint8)


def crop_note(processor: Any, size: tuple[int, int]) -> str | None:
    """A note when the model's processor centre-crops a non-square image (what falls outside is not seen)."""
    config = getattr(processor, "image_processor", None)
    crop = getattr(config, "crop_size", None)
    width, height = size
    if config is None or not getattr(config, "do_center_crop", False) or not crop or width == height:
        return None
    side, long = min(width, height), max(width, height)
    return (f"the image is {width}x{height}; the model's processor resizes its short side and centre-crops a "
            f"square, so only the central {side} of the {long} px along the long side are seen. Crop or pad the "
            "image yourself to choose what the model sees.")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]
