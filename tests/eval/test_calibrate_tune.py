"""``vtprune calibrate`` and ``vtprune tune`` end to end (CPU, offline, a few seconds of model time each)."""

from __future__ import annotations

import json

import pytest
import torch

import vtprune
from vtprune.cli import main
from vtprune.models.loading import load
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)


def test_calibrate_writes_a_file_that_debias_loads(tmp_path, capsys):
    from vtprune.methods.debias import read_calibration

    out = tmp_path / "cal.json"
    assert main(["calibrate", "--model", "tiny:llava", "--n", "12", "--batch-size", "6", "--out", str(out),
                 "--device", "cpu"]) == 0
    record = json.loads(out.read_text())
    assert record["format"] == "vtprune-debias-calibration" and record["method"] == "fastv"
    assert record["stage_layers"] == [2] and record["score_layers"] == [1] and record["n_samples"] == 12
    entry = record["layers"]["1"]
    assert {"sigma", "mu", "r2", "n_pairs", "curve"} <= set(entry) and entry["n_pairs"] == 12 * 16
    assert len(entry["curve"]["x"]) == len(entry["curve"]["mean"]) > 0
    assert {"model", "date", "vtprune_version", "tau", "x"} <= set(record)
    assert (tmp_path / "cal.png").stat().st_size > 1000
    assert "sigma" in capsys.readouterr().out
    debiaser = read_calibration(out)
    assert debiaser.trend(1).sigma == pytest.approx(entry["sigma"])
    model, processor = tiny_model("llava")
    inputs = tiny_inputs(processor, "llava", [("what color?", [random_image(80, 60, 0)])])
    with torch.no_grad(), vtprune.apply(model, "fastv", keep=0.5, debias=str(out)) as handle:
        model(**inputs)
    assert handle.scorer.debiaser.source == str(out) and handle.last_stats.kept == [[8]]


def test_debias_true_uses_the_calibration_shipped_with_the_model(tmp_path):
    from vtprune.eval.tuning.calibrate import calibrate, calibration_items

    model, processor = tiny_model("llava")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    loaded, loaded_processor = load(str(folder), device="cpu")
    record = calibrate(loaded, loaded_processor, calibration_items(None, 6), "pdrop", progress=False)
    assert record["score_layers"] == [1, 2, 3] and record["query"] == "last"
    (folder / "calibration.json").write_text(json.dumps(record))
    inputs = tiny_inputs(processor, "llava", [("what color?", [random_image(80, 60, 0)])])
    with torch.no_grad(), vtprune.apply(loaded, "pdrop+debias", keep=0.25) as handle:
        loaded(**inputs)
    assert handle.scorer.debiaser.source == str(folder / "calibration.json")
    with torch.no_grad(), vtprune.apply(model, "pdrop+debias", keep=0.25) as handle:
        model(**inputs)  # a model without a shipped calibration uses the default trend
    assert handle.scorer.debiaser.source == "default" and handle.scorer.debiaser.trend(1).sigma == 1.9


def test_tune_improves_vflowopt_and_the_result_loads(tmp_path):
    from vtprune.method_config import load_method_config
    from vtprune.methods.budget import average_retention

    out = tmp_path / "tuned.json"
    assert main(["tune", "--model", "embedded:llava", "--method", "vflowopt", "--budget", "0.25", "--trials", "6",
                 "--n-samples", "12", "--seed", "0", "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["method"] == "vflowopt" and len(result["trials"]) == 6
    values = [t["value"] for t in result["trials"] if t["value"] is not None]
    # The best trial is reported, the default configuration (trial 0) is the baseline, and the search explored.
    assert result["objective"] == max(values) >= result["baseline_objective"] == values[0] > 0
    assert len(set(values)) > 1
    options = load_method_config(str(out))
    assert options["budget"] == 0.25 and {"r1", "r2", "threshold", "cell", "alpha", "vit_layer"} <= set(options)
    model, processor = load("embedded:llava", device="cpu")
    handle = vtprune.wrap(model, "vflowopt", **options)
    assert average_retention(handle.stages, 4) == pytest.approx(0.25, abs=1e-6)
    handle.remove()


def test_tune_baselines_search_their_layers(tmp_path):
    from vtprune.eval.tuning.tune import tune

    model, processor = tiny_model("llava")
    result = tune(model, processor, "pdrop+debias", 0.6, trials=3, n_samples=4, progress=False)
    assert result["wrap_options"]["debias"] is True and "schedule" in result["wrap_options"]
    assert all(t["params"]["layer1"] >= 1 for t in result["trials"])
    with pytest.raises(ValueError, match="below what pruning inside the 4-layer"):
        tune(model, processor, "fastv", 0.2, trials=1, n_samples=2, progress=False)
