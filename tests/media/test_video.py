"""Video input (decord / PyAV), the frames route into the model, per-frame budgets and ``vtprune run --video``."""

from __future__ import annotations

import functools
import importlib.util
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vtprune.media.video import fit_frame, frame_inputs, load_video, uniform_indices, video_route
from vtprune.models.tiny import random_image, tiny_model

torch.set_num_threads(1)
av = pytest.importorskip("av")


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type)


def _write(path, frames: list[np.ndarray], codec: str = "libx264", pix_fmt: str = "yuv420p", fps: int = 8) -> str:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = pix_fmt
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return str(path)


@functools.cache
def _shapes_clip():
    from vtprune.shapes.video import generate_video_sample

    sample = generate_video_sample(3, 0)
    return [np.asarray(f) for f in sample.frames], sample.questions[0]


def test_uniform_indices():
    assert uniform_indices(24, 4) == [0, 8, 15, 23]
    assert uniform_indices(3, 8) == [0, 1, 2]
    assert uniform_indices(10, 1) == [0] and uniform_indices(0, 4) == []


@pytest.mark.parametrize("writer", ["pyav-libx264", "cv2-mp4v"])
def test_decord_and_pyav_agree(tmp_path, writer):
    pytest.importorskip("decord")
    frames, _ = _shapes_clip()
    path = str(tmp_path / "clip.mp4")
    if writer == "pyav-libx264":
        _write(path, frames)
    else:
        cv2 = pytest.importorskip("cv2")
        video = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 8, frames[0].shape[1::-1])
        for frame in frames:
            video.write(frame[..., ::-1])
        video.release()
    by_decord, by_pyav = load_video(path, 7, "decord"), load_video(path, 7, "pyav")
    assert by_decord.total_frames == by_pyav.total_frames == len(frames)
    assert by_decord.indices == by_pyav.indices == uniform_indices(len(frames), 7)
    np.testing.assert_allclose(by_decord.times, by_pyav.times, atol=1e-3)
    np.testing.assert_allclose(by_decord.times, [i / 8 for i in by_decord.indices], atol=1e-3)
    for a, b, index in zip(by_decord.frames, by_pyav.frames, by_decord.indices, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).mean() < 1.0  # same bitstream, same decoded pixels (colour conversion aside)
        assert np.abs(a - frames[index]).mean() < 12.0  # and the right source frame (lossy codec)
    assert load_video(path, 7).backend == "decord"


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_video(tmp_path / "missing.mp4")
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_video(empty)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="cannot decode"):
        load_video(garbage)
    zero = tmp_path / "zero.mkv"  # a video stream with no frame (only audio packets were muxed)
    with av.open(str(zero), "w") as container:
        video = container.add_stream("mpeg4", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        samples.sample_rate = 16000
        container.mux(audio.encode(samples))
        container.mux(audio.encode())
    with pytest.raises(ValueError, match="zero length"):
        load_video(zero)
    with pytest.raises(ValueError, match="num_frames"):
        load_video(garbage, 0)


def test_odd_and_tiny_resolutions(tmp_path):
    odd = [np.full((47, 63, 3), 10 * i, np.uint8) for i in range(6)]
    clip = load_video(_write(tmp_path / "odd.mkv", odd, "ffv1", "yuv444p"), 3)
    assert clip.frames[0].size == (63, 47) and clip.indices == [0, 2, 5]  # odd sizes pass through
    small = [np.full((12, 16, 3), 10 * i, np.uint8) for i in range(4)]
    clip = load_video(_write(tmp_path / "small.mkv", small, "ffv1", "yuv444p"), 4)
    assert min(clip.frames[0].size) == 28 and clip.frames[0].size == (38, 28)  # upscaled, aspect kept
    with pytest.raises(ValueError, match="aspect ratio"):
        fit_frame(Image.new("RGB", (4000, 10)))


def test_frames_route_through_the_model_processor():
    """Without torchvision there is no Qwen video processor: frames go in as consecutive images."""
    model, processor = _model("qwen2_vl")
    assert video_route(processor) == "images"
    frames = [random_image(112, 84, i) for i in range(3)]
    inputs = frame_inputs(processor, "qwen2_vl", [frames], ["what color is the circle?"])
    grids = inputs["image_grid_thw"]
    assert grids.tolist() == [[1, 6, 8]] * 3  # one image per frame, each its own temporal position
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert image_tokens == 3 * 12 and not (inputs["input_ids"] == model.config.video_token_id).any()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(ValueError, match="torchvision"):
            video_route(processor, "video")


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="video processors need torchvision")
def test_video_route_with_the_model_video_processor():
    from transformers import Qwen2VLProcessor, Qwen2VLVideoProcessor

    model, images_only = _model("qwen2_vl")
    processor = Qwen2VLProcessor(image_processor=images_only.image_processor, tokenizer=images_only.tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(
                                     patch_size=14, merge_size=2, size=dict(images_only.image_processor.size)))
    frames = [random_image(112, 112, i) for i in range(4)]
    inputs = frame_inputs(processor, "qwen2_vl", [frames], ["what color?"])
    assert inputs["video_grid_thw"].tolist() == [[2, 8, 8]]  # two frames per temporal patch
    assert int((inputs["input_ids"] == model.config.video_token_id).sum()) == 2 * 16
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)


# -- per-frame budgets ---------------------------------------------------------------------------------------
def test_per_frame_scores_rank_within_frames():
    from vtprune.methods.per_frame import per_frame_scores

    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.2, 0.1])
    frames = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    alive = torch.ones(8, dtype=torch.bool)
    out = per_frame_scores(scores, alive, frames, torch.tensor([2, 2]))
    assert set(torch.topk(out, 4).indices.tolist()) == {0, 1, 4, 5}
    alive[0] = False
    out = per_frame_scores(scores, alive, frames, torch.tensor([1, 3]))
    assert out[0] == float("-inf") and set(torch.topk(out, 4).indices.tolist()) == {1, 4, 5, 6}


def test_frame_ids_split_video_segments_into_temporal_patches():
    from vtprune.adapters.base import VisualSegment

    from vtprune.methods.per_frame import frame_ids

    segments = [VisualSegment(0, 1, 2, 2), VisualSegment(4, 3, 2, 2, kind="video")]
    assert frame_ids(segments, 16).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


@pytest.mark.parametrize("method", ["oracle", "fastv", "pdrop"])
def test_per_frame_budget_keeps_each_frames_share(method):
    from vtprune.gridprobe.run import wrap_frames

    model, processor = _model("qwen2_vl")
    inputs = frame_inputs(processor, "qwen2_vl", [[random_image(112, 112, i) for i in range(4)]], ["what?"])
    counts = {}
    for budget in ("global", "per_frame"):
        handle = wrap_frames(model, method, 0.25, budget)
        handle.set_evidence([[1.0] * 16 + [0.0] * 48])  # frame 0 holds all the evidence (oracle)
        with torch.no_grad():
            model(**inputs)
        stats = handle.last_stats
        handle.remove()
        counts[budget] = [[sum(1 for i in kept if i // 16 == f) for f in range(4)] for kept in
                          (stage[0] for stage in stats.kept_indices)]
    assert counts["per_frame"][-1] == [4, 4, 4, 4]
    if method == "oracle":
        assert counts["global"][-1] == [16, 0, 0, 0]


# -- the command line ----------------------------------------------------------------------------------------
def _cli(capsys, *argv) -> tuple[int, str, str]:
    from vtprune.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava"])
def test_cli_video_gridprobe_json(tmp_path, capsys, model_type):
    frames, question = _shapes_clip()
    path = _write(tmp_path / "shapes.mp4", frames)
    code, out, _ = _cli(capsys, "run", "--video", path, "--question", question.text, "--gridprobe", "2", "--json",
                        "--model", f"tiny:{model_type}", "--device", "cpu", "--frame-budget", "per_frame")
    assert code == 0
    record = json.loads(out)
    assert record["answer"] in "ABCD" and 2 <= record["m_eff"] <= 4 and record["k"] == 2
    assert len(record["frames_selected"]) == record["m_eff"] and set(record["frames_selected"]) <= set(
        uniform_indices(len(frames), 4))
    assert record["times_selected"] == pytest.approx([i / 8 for i in record["frames_selected"]], abs=1e-3)
    assert record["flops_ratio"] > 0 and record["video_backend"] == "decord"


def test_cli_video_plain_text_and_errors(tmp_path, capsys):
    frames, _ = _shapes_clip()
    path = _write(tmp_path / "shapes.mp4", frames)
    code, out, _ = _cli(capsys, "run", "--video", path, "--question", "What color is the circle?", "--options",
                        "A) red;B) blue", "--frames", "3", "--model", "tiny:qwen2_vl", "--device", "cpu")
    assert code == 0 and "answer" in out and "all 3 sampled frames" in out and "compute" in out
    assert _cli(capsys, "run", "--video", path, "--model", "tiny:llava")[0] == 2  # no --question
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    code, _, err = _cli(capsys, "run", "--video", str(bad), "--question", "q", "--model", "tiny:llava")
    assert code == 2 and "cannot decode" in err
