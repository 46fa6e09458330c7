"""Long visual contexts: multi-image prompts, token evidence over frames, the long benchmark.

Independent references: which image a visual token belongs to is read from the prompt's own token ids
(Qwen: runs of image tokens between vision delimiters; LLaVA: a fixed number of tokens per image from the
vision config), and the target's tokens are found from the rendered pixels (its palette colour, or what
changes between an evidence frame and a frame without the target), not from the generator's boxes.
"""

from __future__ import annotations

import csv
from functools import cache

import numpy as np
import pytest
import torch
from vtprune.eval.accuracy.long_items import (
    evidence_tokens,
    multi_items,
    recall_metrics,
    token_frames,
    video_items,
)

import vtprune
from vtprune.config import keep_count
from vtprune.gridprobe.run import wrap_frames
from vtprune.media.video import frame_inputs
from vtprune.shapes.multi import generate_multi_sample
from vtprune.shapes.task import PALETTE

torch.set_num_threads(1)
CELL = 28  # both embedded models: one visual token per 28 x 28 px (LLaVA patch 28; Qwen 2x2 merged 14 px)


@cache
def _load(spec: str):
    return vtprune.load(spec, device="cpu")


def image_of_token(model, input_ids: torch.Tensor) -> list[int]:
    """The image (prompt order) of every visual token, from the token ids alone."""
    ids = input_ids[0].tolist()
    config = model.config
    if config.model_type == "llava":
        vision = config.vision_config
        per_image = (vision.image_size // vision.patch_size) ** 2
        count = sum(1 for t in ids if t == config.image_token_id)
        return [i // per_image for i in range(count)]
    image, out, inside = -1, [], False
    for token in ids:
        if token == config.image_token_id:
            if not inside:
                image, inside = image + 1, True
            out.append(image)
        else:
            inside = False
    return out


def covered_cells(pixels: np.ndarray, min_cover: float = 0.25) -> set[int]:
    """Raster indices of the 28 px cells that ``pixels`` (bool H x W) cover by at least ``min_cover``."""
    side = pixels.shape[0] // CELL
    cover = pixels[: side * CELL, : side * CELL].reshape(side, CELL, side, CELL).mean(axis=(1, 3))
    return {int(i) for i in np.flatnonzero(cover.reshape(-1) >= min_cover)}


def target_pixels(image, color: str) -> np.ndarray:
    """Pixels within 60 of the palette colour (jitter <= 18 per channel, noise sigma 4; no other object has it)."""
    return np.linalg.norm(np.asarray(image, np.float32) - np.array(PALETTE[color], np.float32), axis=-1) < 60


@pytest.mark.parametrize("spec", ["embedded:llava", "embedded:qwen2_vl"])
def test_multi_image_prompts_keep_per_image_counts(spec):
    model, processor = _load(spec)
    sample = generate_multi_sample(3_000_017, 5, 4, target=2)
    question = sample.questions[0]
    inputs = frame_inputs(processor, model.config.model_type, [sample.images], [question.text], "images")
    owner = torch.tensor(image_of_token(model, inputs["input_ids"]))
    assert torch.bincount(owner).tolist() == [16] * 4
    target = [o for o in range(len(owner)) if owner[o] == 2]
    evidence = torch.zeros(len(owner))
    cells = sorted(covered_cells(target_pixels(sample.images[2], question.answer)))
    assert cells
    evidence[target[0] + torch.tensor(cells)] = 1
    for budget, method, keep in (("per_frame", "fastv", 0.25), ("per_frame", "pdrop", 0.5), ("per_frame", "oracle", 0.25),
                                 ("global", "oracle", 0.25)):
        handle = wrap_frames(model, method, keep, budget)
        try:
            handle.set_evidence([evidence])
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=1, do_sample=False)
            kept = torch.tensor(handle.last_stats.kept_indices[-1][0])
        finally:
            handle.remove()
        per_image = torch.bincount(owner[kept], minlength=4).tolist()
        if budget == "per_frame":  # every image keeps its own keep_count, whatever the scores say
            assert per_image == [keep_count(keep, 16)] * 4, (method, per_image)
        else:  # one budget over the prompt: the oracle puts the target's tokens first, all in image 2
            assert set(kept.tolist()) >= set(evidence.nonzero().flatten().tolist())
            assert per_image[2] >= int(evidence.sum()) and sum(per_image) == keep_count(keep, 64)


@pytest.mark.parametrize("spec", ["embedded:llava", "embedded:qwen2_vl"])
def test_multi_image_evidence_tokens_match_the_rendered_target(spec):
    model, processor = _load(spec)
    from vtprune.adapters import get_adapter

    for item in multi_items("test", 3, 4)[::3]:  # the colour question of three sets
        inputs = frame_inputs(processor, model.config.model_type, [item.frames], [item.question], "images")
        owner = image_of_token(model, inputs["input_ids"])
        segments = get_adapter(model).segments(inputs["input_ids"], inputs)[0]
        marked = evidence_tokens(item, segments, len(owner)).nonzero().flatten().tolist()
        image = item.evidence[0]
        first = owner.index(image)
        rendered = {first + c for c in covered_cells(target_pixels(item.frames[image], item.answer))}
        assert rendered and marked and {owner[o] for o in marked} == {image}
        assert rendered <= set(marked)  # the shape lies inside its box: cells it covers are box-covered too


def test_video_evidence_tokens_lie_where_the_frames_change():
    model, processor = _load("embedded:qwen2_vl")
    from vtprune.adapters import get_adapter

    item = video_items("test", 1)[0]
    inputs = frame_inputs(processor, model.config.model_type, [item.frames], [item.question], "images")
    owner = image_of_token(model, inputs["input_ids"])
    segments = get_adapter(model).segments(inputs["input_ids"], inputs)[0]
    evidence = evidence_tokens(item, segments, len(owner))
    blank = next(f for f in range(len(item.frames)) if f not in item.evidence)
    for frame in item.evidence:  # the target is what differs from a frame without it (noise sigma 4)
        changed = np.abs(np.asarray(item.frames[frame], np.float32) - np.asarray(item.frames[blank], np.float32))
        cells = covered_cells(changed.max(axis=-1) > 40)
        first = owner.index(frame)
        marked = {o - first for o in evidence.nonzero().flatten().tolist() if owner[o] == frame}
        assert cells and cells <= marked
    assert {owner[o] for o in evidence.nonzero().flatten().tolist()} == set(item.evidence)
    frames = token_frames(segments, len(owner))
    assert frames.tolist() == owner
    assert recall_metrics(evidence, None, frames) == {"recall": 1.0, "hit": 1.0, "best_frame": 1.0}
    one = [int(evidence.nonzero()[0])]
    metrics = recall_metrics(evidence, one, frames)
    assert metrics["recall"] == pytest.approx(1 / int(evidence.sum())) and metrics["hit"] == 1.0


def test_bench_long_writes_rows_for_every_method_keep_and_type(tmp_path):
    from vtprune.eval.accuracy.long import main

    main(["--setting", "multi", "--model", "embedded:llava", "--images", "2", "--sets", "1", "--methods",
          "none,oracle,fastv,fastv@per_frame", "--keep", "0.25", "--out", str(tmp_path)])
    with (tmp_path / "long.csv").open() as f:
        rows = list(csv.DictReader(f))
    keys = {(r["method"], float(r["keep"]), r["qtype"]) for r in rows}
    methods = (("none", 1.0), ("oracle", 0.25), ("fastv", 0.25), ("fastv@per_frame", 0.25))
    assert keys == {(m, k, q) for m, k in methods for q in ("all", "color", "shape", "where")}
    by = {(r["method"], r["qtype"]): r for r in rows}
    assert float(by[("oracle", "all")]["evidence_recall"]) == 1.0
    assert float(by[("none", "all")]["flops_ratio"]) == 1.0 and float(by[("fastv", "all")]["flops_ratio"]) < 1
    assert float(by[("fastv@per_frame", "all")]["mean_kept_tokens"]) == 2 * keep_count(0.25, 16)
    assert {"git_sha", "git_dirty", "weights_sha", "device", "threads"} <= set(rows[0])
    assert (tmp_path / "long.md").read_text().count("| fastv |") >= 2 and (tmp_path / "long.png").stat().st_size


def test_calibrate_fits_the_trend_on_all_frames_of_clips(tmp_path):
    import json

    from vtprune.eval.accuracy.long_debias import binned_trend

    from vtprune.cli import main as cli
    from vtprune.methods.debias import read_calibration

    out = tmp_path / "cal.json"
    assert cli(["calibrate", "--model", "embedded:qwen2_vl", "--video", "--n", "3", "--batch-size", "2",
                "--out", str(out), "--device", "cpu"]) == 0
    record = json.loads(out.read_text())
    clips = video_items("calib", 2)[:3]
    visual = sum(16 * len(item.frames) for item in clips)  # 16 tokens per frame, every frame of each clip
    assert record["n_samples"] == 3 and record["layers"]["1"]["n_pairs"] == visual
    assert record["data"].startswith("calib clips")
    assert read_calibration(out).trend(1).sigma == pytest.approx(record["layers"]["1"]["sigma"])
    flat = binned_trend({"x": [0.1, 0.4, 0.6, 0.9], "mean": [1.0, 1.0, 1.0, 1.0], "count": [1, 1, 1, 1]})
    rising = binned_trend({"x": [0.1, 0.4, 0.6, 0.9], "mean": [1.0, 2.0, 3.0, 4.0], "count": [1, 1, 1, 1]})
    assert flat["last_first_ratio"] == 1.0 and rising["last_first_ratio"] == 4.0 and rising["binned_sigma"] > 1


def test_clips_past_the_context_are_one_line(tmp_path, capsys):
    """64 frames do not fit the embedded Qwen2-VL's 1,024 positions: one line saying how many do, status 2."""
    from vtprune.eval.accuracy.long import main

    code = main(["--setting", "video", "--frames", "64", "--clips", "1", "--methods", "none", "--keep", "0.25",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "at most 55 frames fit" in err, err


def _records(folder) -> list[dict]:
    import json

    return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines() if line.strip()]


def test_resume_continues_only_its_own_run_and_each_answer_once(tmp_path, capsys):
    """A resumed run refuses other options and a records file it did not write; a run cut in the middle of a
    question finishes it without repeating an answer (answers matched by question, method and keep)."""
    from vtprune.eval.accuracy.long import main

    run = ["--setting", "multi", "--model", "embedded:llava", "--images", "2", "--sets", "1", "--methods",
           "none,fastv", "--keep", "0.25", "--out", str(tmp_path)]
    assert main(run) == 0
    capsys.readouterr()
    full = _records(tmp_path)
    assert len(full) == 3 * 2  # 3 questions x (none, fastv 0.25)
    for other in (["--methods", "none,pdrop"], ["--keep", "0.5"], ["--sets", "2"], ["--images", "3"]):
        with pytest.raises(SystemExit) as stop:
            main([*run, *other, "--resume"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "other options" in err, err
        assert other[0] in err, err
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    (tmp_path / "records.jsonl").write_text("\n".join(lines[:3]) + "\n")  # cut after the second question's `none`
    assert main([*run, "--resume"]) == 0
    capsys.readouterr()
    resumed = _records(tmp_path)
    key = lambda r: (r["item"], r["question"], r["method"], r["keep"])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, full)) and resumed[:3] == full[:3]
    (tmp_path / "run.json").unlink()  # records this command did not write (or from before run.json)
    with pytest.raises(SystemExit) as stop:
        main([*run, "--resume"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "run.json" in err and "--force" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,words", [
    (["--resume", "--force"], "not both"), (["--methods", "none,fastv,fastv"], "'fastv' is listed twice"),
    (["--keep", "0.5,0.50"], "'0.5' and '0.50' are listed twice"), (["--images", "2,2"], "'2' is listed twice"),
])
def test_bench_long_refuses_contradicting_or_repeated_options(tmp_path, capsys, extra, words):
    from vtprune.eval.accuracy.long import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--setting", "multi", "--out", str(tmp_path / "r"), *extra])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
