"""Video decoding under bad input: bounded resolution and frame count, refused sources, rotation, CLI checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from vtprune.cli import main
from vtprune.errors import UserError
from vtprune.media import video_io
from vtprune.media.video import load_video

av = pytest.importorskip("av")


def _write(path, frames: list[np.ndarray], fps: int = 8) -> str:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return str(path)


def _frames(height: int, width: int, count: int) -> list[np.ndarray]:
    """Frames with a red top-left quadrant (orientation visible) and a per-frame brightness."""
    out = []
    for index in range(count):
        frame = np.full((height, width, 3), 20 + 10 * index, np.uint8)
        frame[: height // 2, : width // 2] = (230, 20, 20)
        out.append(frame)
    return out


def _tag_rotation(path: str, degrees: int) -> None:
    """Write an ISO-BMFF display matrix into the video track header (``tkhd``), like phone cameras do.

    The matrix maps stored pixel ``(x, y)`` to ``(a x + c y, b x + d y)``: ``90`` is ``(a, b, c, d) = (0, 1, -1, 0)``,
    which shows the stored top-left corner at the top right (a clockwise quarter turn on screen).
    """
    one, minus = 0x10000, 0xFFFF0000
    a, b, c, d = {90: (0, one, minus, 0), 180: (minus, 0, 0, minus), 270: (0, minus, one, 0)}[degrees]
    data = bytearray(open(path, "rb").read())
    box = data.find(b"tkhd") - 4
    version = data[box + 8]
    matrix = box + 8 + 4 + (28 if version == 1 else 20) + 8 + 8
    data[matrix:matrix + 36] = struct.pack(">9I", a, b, 0, c, d, 0, 0, 0, 0x40000000)
    open(path, "wb").write(bytes(data))


class _FrameSpy:
    """A PyAV frame that records conversions: full-resolution ones are what bounded decoding must avoid."""

    def __init__(self, frame, log: dict) -> None:
        self._frame, self._log = frame, log

    def __getattr__(self, name):
        return getattr(self._frame, name)

    def reformat(self, width=None, height=None, **kwargs):
        self._log["reformat"].append((width, height))
        return self._frame.reformat(width=width, height=height, **kwargs)

    def to_image(self, *args, **kwargs):
        self._log["full"].append("to_image")
        return self._frame.to_image(*args, **kwargs)

    def to_ndarray(self, *args, **kwargs):
        self._log["full"].append("to_ndarray")
        return self._frame.to_ndarray(*args, **kwargs)


def test_pyav_scales_inside_the_decoder(tmp_path, monkeypatch):
    path = _write(tmp_path / "big.mp4", _frames(720, 960, 6))
    log = {"reformat": [], "full": []}
    real_open = av.open

    class Container:
        def __init__(self, *args, **kwargs):
            self._container = real_open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._container.close()

        def __getattr__(self, name):
            return getattr(self._container, name)

        def decode(self, *args, **kwargs):
            return (_FrameSpy(frame, log) for frame in self._container.decode(*args, **kwargs))

    monkeypatch.setattr(av, "open", Container)
    clip = load_video(path, 3, "pyav", max_pixels=160 * 120)
    assert log["full"] == []  # no full-resolution RGB frame was ever built
    assert log["reformat"] and all(w * h <= 160 * 120 for w, h in log["reformat"])
    assert [f.size for f in clip.frames] == [(160, 120)] * 3 and clip.indices == [0, 2, 5]


def test_decord_is_asked_for_the_bounded_size(tmp_path, monkeypatch):
    decord = pytest.importorskip("decord")
    path = _write(tmp_path / "big.mp4", _frames(720, 960, 6))
    asked = []
    real = decord.VideoReader

    def reader(*args, **kwargs):
        asked.append((kwargs.get("width"), kwargs.get("height")))
        return real(*args, **kwargs)

    monkeypatch.setattr(decord, "VideoReader", reader)
    clip = load_video(path, 3, "decord", max_pixels=160 * 120)
    assert asked == [(160, 120)] and clip.backend == "decord"
    assert [f.size for f in clip.frames] == [(160, 120)] * 3


def test_default_caps_bound_every_frame_and_the_clip(tmp_path):
    path = _write(tmp_path / "hd.mp4", _frames(1088, 1920, 3))
    for backend in ("auto", "pyav"):
        clip = load_video(path, 3, backend)
        width, height = clip.frames[0].size
        assert width * height <= video_io.MAX_FRAME_PIXELS and abs(width / height - 1920 / 1088) < 0.02
    assert video_io.frame_pixel_cap(8) == video_io.MAX_FRAME_PIXELS
    assert video_io.frame_pixel_cap(video_io.MAX_FRAMES) * video_io.MAX_FRAMES <= video_io.MAX_CLIP_PIXELS
    for count in (0, video_io.MAX_FRAMES + 1, 100_000):
        with pytest.raises(UserError, match="num_frames"):
            load_video(path, count)


def test_sources_above_the_cap_are_refused_before_decoding(tmp_path, monkeypatch):
    path = _write(tmp_path / "clip.mp4", _frames(96, 128, 2))
    monkeypatch.setattr(video_io, "MAX_SOURCE_PIXELS", 100 * 100)
    decoded = []
    monkeypatch.setattr(video_io, "decode_pyav", lambda *a, **k: decoded.append(1))
    with pytest.raises(UserError, match=r"128x96 per frame .* Downscale it first"):
        load_video(path, 2)
    assert decoded == []


@pytest.mark.parametrize("degrees", [90, 180, 270])
def test_backends_agree_on_rotated_clips_and_frames_come_out_upright(tmp_path, degrees):
    frames = _frames(48, 96, 5)
    path = _write(tmp_path / "rotated.mp4", frames)
    _tag_rotation(path, degrees)
    turns = {90: -1, 180: 2, 270: 1}  # np.rot90 counts counter-clockwise quarter turns
    expected = [np.rot90(frame, turns[degrees]) for frame in frames]
    clips = [load_video(path, 3, backend) for backend in ("auto", "decord", "pyav")]
    for clip in clips:
        assert clip.indices == [0, 2, 4] and any("rotated" in note for note in clip.notes)
        for frame, index in zip(clip.frames, clip.indices, strict=True):
            seen = np.asarray(frame, np.float32)
            assert seen.shape == expected[index].shape
            assert np.abs(seen - expected[index]).mean() < 8.0
    for clip in clips[1:]:
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(clips[0].frames, clip.frames, strict=True))


@pytest.mark.parametrize("argv,words", [
    (["--frames", "0"], "--frames: must be between 1 and 256"),
    (["--frames", "100000"], "--frames: must be between 1 and 256"),
    (["--gridprobe", "0"], "--gridprobe: must be between 1 and 16"),
    (["--probe-pixels", "0"], "--probe-pixels: must be between 784"),
    (["--image", "x.png"], "give either --image or --video, not both"),
    (["--question", " "], "--video needs --question"),
    (["--device", "cuda:7"], "--device 'cuda:7'"),
    (["--model", "/no/such/model"], "no such folder"),
])
def test_cli_video_arguments_are_checked_before_any_work(tmp_path, capsys, monkeypatch, argv, words):
    import vtprune.media.video
    import vtprune.models.loading

    path = _write(tmp_path / "clip.mp4", _frames(48, 64, 2))
    monkeypatch.setattr(vtprune.models.loading, "load", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setattr(vtprune.media.video, "load_video", lambda *a, **k: pytest.fail("video decoded"))
    base = ["run", "--video", path, "--model", "tiny:qwen2_vl", "--device", "cpu", "--question", "Which?"]
    assert exit_code([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def exit_code(argv: list[str]) -> int:
    """``main(argv)``, or the status argparse exits with (``parser.error``)."""
    try:
        return main(argv)
    except SystemExit as error:
        return int(error.code)


def test_a_text_file_named_mp4_is_a_bad_file(tmp_path, capsys):
    fake = tmp_path / "fake.mp4"
    fake.write_text("not a video at all\n" * 20)
    assert main(["run", "--video", str(fake), "--question", "q", "--model", "tiny:llava", "--device", "cpu"]) == 2
    assert "cannot decode video" in capsys.readouterr().err


def test_video_run_notes_the_centre_crop_of_non_square_frames(tmp_path, capsys):
    import json

    path = _write(tmp_path / "wide.mp4", _frames(48, 64, 3))
    assert main(["run", "--video", path, "--question", "Which?", "--options", "A) red;B) blue", "--frames", "2",
                 "--model", "tiny:llava", "--device", "cpu", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert any(note.startswith("frames: the image is 64x48") for note in record["notes"]), record["notes"]


def test_video_question_longer_than_the_context_is_refused(tmp_path, capsys):
    path = _write(tmp_path / "clip.mp4", _frames(48, 64, 4))
    question = "why " * 12_500  # ~50,000 characters, past the tiny model's 4,096 positions
    for extra in ([], ["--gridprobe", "2"]):
        assert main(["run", "--video", path, "--question", question, "--model", "tiny:qwen2_vl", "--device", "cpu",
                     "--frames", "4", *extra]) == 2
        err = capsys.readouterr().err
        assert "past the model's context of 4096 positions" in err and "Traceback" not in err, err
