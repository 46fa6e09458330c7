"""Image files given by the user: one clear error per bad file, EXIF orientation, 16-bit PNGs, crop notes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from vtprune.cli import main
from vtprune.errors import UserError
from vtprune.media.images import MAX_IMAGE_PIXELS, aspect_limit, crop_note, open_image, to_rgb

ORIENTATION = 0x0112


def _photo(size: tuple[int, int] = (64, 40)) -> Image.Image:
    """A non-symmetric picture: red top-left quadrant on a blue-green gradient."""
    width, height = size
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :].repeat(height, 0)
    pixels = np.stack([np.zeros_like(x), x, 255 - x], axis=-1).astype(np.uint8)
    pixels[: height // 2, : width // 2] = (255, 0, 0)
    return Image.fromarray(pixels)


def _bad_files(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, words the error must contain)."""
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.png").write_text("this is not an image\n")
    good = tmp_path / "good.png"
    _photo((256, 256)).save(good)
    data = good.read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "folder.png").mkdir()
    bomb = tmp_path / "bomb.png"  # a tiny file whose header declares 20000 x 20000 pixels
    Image.new("1", (20000, 20000)).save(bomb, optimize=True)
    Image.new("1", (5000, 4000)).save(tmp_path / "large.png", optimize=True)  # 20 MP: below Pillow's own guard
    Image.new("RGB", (3000, 10)).save(tmp_path / "thin.png")
    return {"missing": (str(tmp_path / "missing.png"), "does not exist"),
            "empty": (str(tmp_path / "empty.png"), "empty (0 bytes)"),
            "not an image": (str(tmp_path / "notes.png"), "not an image file"),
            "truncated": (str(tmp_path / "truncated.png"), "truncated or corrupt"),
            "folder": (str(tmp_path / "folder.png"), "is a folder"),
            "bomb": (str(bomb), "up to 16.8 MP"),
            "large": (str(tmp_path / "large.png"), "5000x4000 pixels (20.0 MP)"),
            "thin": (str(tmp_path / "thin.png"), "aspect ratio above 200:1")}


def test_bad_image_files_raise_one_clear_user_error(tmp_path):
    files = _bad_files(tmp_path)
    for name, (path, words) in files.items():
        with pytest.raises(UserError, match=re.escape(words)) as error:
            open_image(path, max_aspect=aspect_limit("qwen2_vl"))
        assert path in str(error.value) and "\n" not in str(error.value), name
    assert MAX_IMAGE_PIXELS < 20000 * 20000
    assert open_image(files["thin"][0]).size == (3000, 10)  # no aspect limit unless the model has one
    assert aspect_limit("llava") is None and aspect_limit("qwen2_5_vl") == 200


def test_cli_reports_bad_images_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    import vtprune.models.loading

    monkeypatch.setattr(vtprune.models.loading, "load", lambda *a, **k: pytest.fail("model loaded for a bad image"))
    for name, (path, words) in _bad_files(tmp_path).items():
        model = "tiny:qwen2_vl" if name == "thin" else "tiny:llava"  # Qwen-VL's processor refuses above 200:1
        assert main(["run", "--image", path, "--model", model, "--device", "cpu"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("vtprune: error: ") and words in err and "Traceback" not in err, (name, err)
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("orientation,turn", [(3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_90),
                                              (8, Image.Transpose.ROTATE_270), (2, Image.Transpose.FLIP_LEFT_RIGHT)])
def test_exif_orientation_is_applied(tmp_path, orientation, turn):
    upright = _photo()
    stored = upright.transpose(turn)  # the pixels as a camera stores them; the tag says how to turn them back
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    path = tmp_path / "photo.jpg"
    stored.save(path, exif=exif, quality=95)
    seen = np.asarray(open_image(path), np.float32)
    assert seen.shape == np.asarray(upright).shape
    assert np.abs(seen - np.asarray(upright, np.float32)).mean() < 4.0  # JPEG noise only
    plain = tmp_path / "plain.jpg"
    stored.save(plain, quality=95)  # the same pixels without the tag stay as stored
    assert np.asarray(open_image(plain)).shape == np.asarray(stored).shape


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    path = tmp_path / "ramp16.png"
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode.startswith("I")
    rgb = np.asarray(open_image(path))
    expected = np.round(ramp / 257.0)
    assert rgb.dtype == np.uint8 and rgb.shape == (64, 64, 3)
    assert np.abs(rgb[..., 0].astype(float) - expected).max() <= 1.0
    assert 120 < rgb.mean() < 135  # mid-grey on average, not "almost white" (Pillow's convert clips to 255)
    floats = Image.fromarray(np.full((4, 4), 0.5, np.float32), "F")
    assert np.asarray(to_rgb(floats))[0, 0, 0] == 128


def test_exif_rotated_photo_answers_like_its_upright_copy(tmp_path, capsys):
    from vtprune.shapes.task import make_split

    sample = make_split("test", 1)[0]
    upright_path, rotated_path = tmp_path / "upright.png", tmp_path / "rotated.jpg"
    sample.image.save(upright_path)
    upright = open_image(upright_path)
    upright.save(tmp_path / "upright.jpg", quality=100, subsampling=0)
    exif = Image.Exif()
    exif[ORIENTATION] = 6  # stored turned a quarter to the left; the tag turns it back
    upright.transpose(Image.Transpose.ROTATE_90).save(rotated_path, exif=exif, quality=100, subsampling=0)
    answers = []
    for path in (tmp_path / "upright.jpg", rotated_path):
        assert main(["run", "--image", str(path), "--question", sample.questions[0].text, "--json",
                     "--device", "cpu"]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["answer"] == answers[1]["answer"]
    assert answers[0]["kept_indices"] == answers[1]["kept_indices"]


def test_non_square_images_get_a_crop_note(tmp_path, capsys):
    from vtprune.models.loading import load

    _, processor = load("embedded:llava", device="cpu")
    assert crop_note(processor, (200, 100)) and "centre-crops" in crop_note(processor, (200, 100))
    assert crop_note(processor, (100, 100)) is None
    path = tmp_path / "wide.png"
    _photo((224, 112)).save(path)
    assert main(["run", "--image", str(path), "--json", "--device", "cpu"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert any("centre-crops" in note for note in record["notes"])
    assert main(["run", "--image", str(path), "--device", "cpu"]) == 0
    assert "note      the image is 224x112" in capsys.readouterr().out


def test_demo_uploads_use_the_same_image_checks(tmp_path):
    from vtprune.demo.uploads import UploadError, check_upload, load_image

    files = _bad_files(tmp_path)
    expected = {"empty": "empty.png is empty (0 bytes)", "truncated": "truncated.png is not a readable image",
                "not an image": "notes.png is not a readable image", "thin": "thin.png is 3000x10, an aspect ratio",
                "large": "large.png is 5000x4000 pixels"}
    for name, words in expected.items():
        with pytest.raises(UploadError, match=re.escape(words)):
            check_upload(files[name][0], [tmp_path])
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    _photo().transpose(Image.Transpose.ROTATE_90).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    assert check_upload(tmp_path / "phone.jpg", [tmp_path]) == "image"
    assert load_image(tmp_path / "phone.jpg").size == _photo().size


def test_a_truncated_image_is_refused_even_where_pillow_was_told_to_accept_them(tmp_path, monkeypatch):
    """lmms-eval's import sets Pillow's process-wide LOAD_TRUNCATED_IMAGES; vtprune still refuses the file."""
    from PIL import ImageFile

    path, words = _bad_files(tmp_path)["truncated"]
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(UserError, match=re.escape(words)):
        open_image(path)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the caller's setting is left as it was
