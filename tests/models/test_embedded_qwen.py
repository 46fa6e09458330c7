"""The shipped tiny Qwen2-VL: offline loading, an accuracy floor on images and clips, and GridProbe on clips.

The GridProbe test measures what frame selection is for: on a seeded slice of the `test` video split,
the frames GridProbe selects contain an evidence frame more often than the same number of uniformly sampled
frames. Thresholds are stated next to the measured values.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vtprune.eval.training import evaluate as E  # noqa: E402

from vtprune.models.embedded import embedded_model_path  # noqa: E402
from vtprune.shapes import task as S  # noqa: E402
from vtprune.shapes import video as V  # noqa: E402

N_CLIPS = 24  # 48 questions
# Measured on the shipped model (CPU, fp32, SDPA; `test` split): images overall 0.818 on 200 images
# (colour 0.985, shape 0.995, exists 0.985, read 0.000) and 0.830 on the 8-image slice below (read 0 of 8);
# clips with their evidence, open-ended 0.980 on 100 clips (1.00 on the 12 below), multiple choice 0.255
# (letters not learned, chance 0.25); GridProbe (K = 4, open-ended probes) puts an evidence frame among its
# M_eff frames for 0.979 of these 48 questions against 0.479 for M_eff uniformly sampled frames (mean M_eff 4.46).
IMAGE_FLOOR = 0.75
VIDEO_OPEN_FLOOR = 0.85
PROBE_OPEN_ENDED = True
GRIDPROBE_HIT = 0.9
GRIDPROBE_MARGIN = 0.3


@pytest.fixture(scope="module")
def loaded():
    from vtprune.models.loading import load

    torch.manual_seed(0)
    return load("embedded:qwen2_vl", device="cpu")


@pytest.fixture(scope="module")
def clips():
    return [V.generate_video_sample(S.SPLIT_SEEDS["test"], i) for i in range(N_CLIPS)]


def test_files_size_and_card() -> None:
    path = embedded_model_path("qwen2_vl")
    weights = list(path.glob("*.safetensors"))
    assert weights and sum(w.stat().st_size for w in weights) < 32 * 2**20
    assert (path / "README.md").is_file() and (path / "calibration.json").is_file()


def test_loads_offline_with_a_torchvision_free_processor(loaded) -> None:
    model, processor = loaded
    assert model.config.model_type == "qwen2_vl" and processor.video_processor is None
    assert processor.tokenizer.padding_side == "left"


def test_image_accuracy_floor(loaded) -> None:
    model, processor = loaded
    acc = E.evaluate(model, processor, S.make_split("test", 8), batch_size=32)
    assert acc["overall"] >= IMAGE_FLOOR, acc


def test_video_accuracy_floor(loaded, clips) -> None:
    model, processor = loaded
    acc = E.evaluate_video(model, processor, clips[:12])
    assert acc["video_open"] >= VIDEO_OPEN_FLOOR, acc


def test_gridprobe_finds_evidence_frames_more_often_than_uniform(loaded, clips) -> None:
    from vtprune.gridprobe.run import run_gridprobe
    from vtprune.media.video import uniform_indices
    from vtprune.shapes.video import open_form

    model, processor = loaded
    hits = uniform_hits = 0
    questions = [(clip, q) for clip in clips for q in clip.questions]
    for clip, q in questions:
        text = open_form(q)[0] if PROBE_OPEN_ENDED else q.text
        result = run_gridprobe(model, processor, clip.frames, text, k=4, max_new_tokens=2)
        hits += bool(set(result.frames_selected) & set(q.frames))
        uniform_hits += bool(set(uniform_indices(len(clip.frames), result.m_eff)) & set(q.frames))
    rate, uniform_rate = hits / len(questions), uniform_hits / len(questions)
    assert rate >= GRIDPROBE_HIT and rate >= uniform_rate + GRIDPROBE_MARGIN, (rate, uniform_rate)
