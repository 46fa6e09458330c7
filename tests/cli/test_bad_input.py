"""Bad input of files and options: each is refused in one line naming the value (or file and field) and the fix,
before any work; the command line exits with status 2 and prints no usage block or traceback."""

from __future__ import annotations

import json

import pytest
import torch

import vtprune
from vtprune.config import PruneConfig
from vtprune.errors import UserError
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

SHIPPED_QWEN = "vtprune/models/vtprune-qwen2vl-shapes/calibration.json"


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err and "usage:" not in err


# -- files fitted on another model -------------------------------------------------------------------------------
def test_a_debias_calibration_of_another_model_type_is_refused(tmp_path, cli):
    data = json.loads(open(SHIPPED_QWEN).read())
    assert data["model_type"] == "qwen2_vl"
    path = tmp_path / "qwen_fit.json"
    path.write_text(json.dumps(data))
    model, _ = tiny_model("llava")
    with pytest.raises(UserError, match=r"qwen_fit.json'.*field 'model_type' is 'qwen2_vl'.*'llava'"):
        vtprune.wrap(model, "fastv", keep=0.5, debias=str(path))
    code, _, err = cli("run", "--model", "embedded:llava", "--method", "fastv+debias", "--debias", str(path))
    assert code == 2 and "field 'model_type'" in err and _one_line(err), err
    data["model_type"] = "llava"  # the same fit declared for this model type is used
    path.write_text(json.dumps(data))
    vtprune.wrap(model, "fastv", keep=0.5, debias=str(path)).remove()
    data["layers"]["30"] = data["layers"][sorted(data["layers"])[0]]  # a fit of a deeper model of the same type
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"field 'layers.30' is beyond the model's 4 decoder layers"):
        vtprune.wrap(model, "fastv", keep=0.5, debias=str(path))


def _profile(tmp_path, budgets) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "vtprune-prefixkv-profile", "model_type": "llava", "num_layers": 2,
                                "scope": "prompt", "budgets": budgets}))
    return str(path)


@pytest.mark.parametrize("budgets,words", [
    ({"abc": [0.5, 0.5]}, "budgets key 'abc' must be a keep fraction"),
    ({"nan": [0.5, 0.5]}, "budgets key 'nan' must be a keep fraction"),
    ({"0.5": [True, False]}, "budgets['0.5'] must be 2 ratios in [0, 1] (numbers, not true/false"),
])
def test_prefixkv_profiles_name_the_file_and_the_bad_key(tmp_path, budgets, words):
    from vtprune.methods.prefixkv import read_profile

    path = _profile(tmp_path, budgets)
    with pytest.raises(UserError) as error:
        read_profile(path, "llava", 2, "prompt")
    assert path in str(error.value) and words in str(error.value), str(error.value)


# -- options of the Python API -----------------------------------------------------------------------------------
@pytest.mark.parametrize("options,words", [
    ({"schedule": ",,,"}, "has no LAYER:KEEP stage"),
    ({"schedule": []}, "has no LAYER:KEEP stage"),
    ({"schedule": [(1.7, 0.5)]}, "must be an integer decoder-layer index, got 1.7"),
    ({"schedule": [(True, 0.5)]}, "must be an integer decoder-layer index, got True"),
    ({"schedule": [(2, "abc")]}, "must be a number in (0, 1], got 'abc'"),
    ({"schedule": [(2, 0.5, 1)]}, "must be a (layer, keep) pair"),
    ({"schedule": 3}, "must be a string 'LAYER:KEEP,...'"),
    ({"layer": 1.7}, "must be an integer decoder-layer index, got 1.7"),
    ({"layer": -1}, "pruning layer -1 is outside the language model"),
    ({"keep": True}, "keep must be a number in (0, 1], got True"),
    ({"keep": float("nan")}, "keep must be in (0, 1]"),
    ({"keep": float("inf")}, "keep must be in (0, 1]"),
    ({"keep": "abc"}, "keep must be a number in (0, 1]"),
])
def test_wrap_refuses_bad_schedules_layers_and_keeps(options, words):
    model, _ = tiny_model("llava")
    with pytest.raises(ValueError) as error:
        vtprune.wrap(model, "fastv", **options)
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("method,options,words", [
    ("visionzip", {"vit_layer": 1.5}, "vit_layer must be an integer decoder-layer index, got 1.5"),
    ("vflowopt", {"vit_layer": 1.5}, "vit_layer must be an integer decoder-layer index, got 1.5"),
    ("ttv", {"ttv_start": 1.5}, "ttv_start must be an integer decoder-layer index, got 1.5"),
    ("visionzip", {"contextual": True}, "contextual=True is the fraction"),
    ("prefixkv", {"query_rows": True}, "query_rows=True must be a positive int"),
    ("prefixkv", {"start": True}, "start=True must be an int >= 0"),
    ("prefixkv", {"distance": 1.5}, "distance=1.5 must be an int"),
    ("random", {"seed": 1.5}, "seed=1.5 must be an int"),
    ("random", {"seed": "abc"}, "seed='abc' must be an int"),
    ("transprune", {"abs_cos": "no"}, "abs_cos='no' must be True or False"),
    ("transprune", {"alpha": True}, "alpha=True must be a finite number in [0, 1]"),
    ("vflowopt", {"r1": True}, "r1=True must be a finite number in (0, 1]"),
    ("vflowopt", {"threshold": float("nan")}, "threshold=nan must be a finite number >= 0"),
    ("vflowopt", {"alpha": "abc"}, "alpha='abc' must be a finite number (weight"),
    ("vflowopt", {"cell": float("nan")}, "cell=nan must be a finite number > 0"),
    ("vflowopt", {"recycle": "false"}, "recycle='false' must be True or False"),
    ("vflowopt", {"image_mean": "abc"}, "image_mean='abc' must be three numbers"),
    ("vflowopt", {"image_std": [0.2, 0.0, 0.2]}, "image_std[1]=0.0 must be a finite number > 0"),
    ("temporal", {"retain": True}, "retain=True must be a finite number in (0, 1]"),
    ("temporal", {"then": "fastv", "then_options": 3}, "then_options=3 must be a dict"),
    ("visionzip", {"queries": 100}, "queries=100 samples the queries of a Qwen-VL tower's map"),
])
def test_method_options_are_not_truncated_or_taken_from_bools(method, options, words):
    model, _ = tiny_model("llava")
    with pytest.raises(ValueError) as error:
        vtprune.wrap(model, method, keep=0.5, **options)
    assert words in str(error.value), str(error.value)


def test_an_integral_float_layer_is_that_layer():
    assert PruneConfig(method="fastv", schedule=[(2.0, 0.5)]).stages[0].layer == 2
    assert PruneConfig(method="fastv", layer=2.0).stages[0].layer == 2


def test_kernel_environment_is_checked_at_wrap(monkeypatch, cli):
    import vtprune.kernels._dispatch as dispatch

    model, _ = tiny_model("llava")
    monkeypatch.setenv("VTPRUNE_KERNEL_IMPL", "triton")
    monkeypatch.setattr(dispatch, "triton_import_error", lambda: ModuleNotFoundError("No module named 'triton'"))
    with pytest.raises(ValueError, match=r"VTPRUNE_KERNEL_IMPL=triton but `import triton` failed"):
        vtprune.wrap(model, "fastv", keep=0.5)
    code, _, err = cli("run", "--model", "tiny:llava", "--device", "cpu")
    assert code == 2 and "import triton" in err and _one_line(err), err
    monkeypatch.setattr(dispatch, "triton_import_error", lambda: None)  # triton imports, but the model is on CPU
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        vtprune.wrap(model, "fastv", keep=0.5)
    monkeypatch.setenv("VTPRUNE_KERNEL_IMPL", "fast")
    with pytest.raises(ValueError, match="VTPRUNE_KERNEL_IMPL='fast' is not one of"):
        vtprune.wrap(model, "fastv", keep=0.5)
    monkeypatch.setenv("VTPRUNE_KERNEL_IMPL", "torch")
    vtprune.wrap(model, "fastv", keep=0.5).remove()


def test_dart_notes_pivots_that_take_the_whole_budget():
    model, processor = tiny_model("llava")
    prompt = "USER: <image>\nwhat color is the circle? ASSISTANT:"
    inputs = processor(images=[random_image(64, 64, 1)], text=[prompt], return_tensors="pt")
    handle = vtprune.wrap(model, "dart", keep=0.25, pivot_image=100_000)
    try:
        with pytest.warns(UserWarning, match=r"pivot_image=100000 is more than the \d+ visual tokens"), torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()


# -- the command line --------------------------------------------------------------------------------------------
RUN_CASES = [
    (["--schedule", ",,,"], "has no LAYER:KEEP stage"),
    (["--question", "<image> What color <image> is it?"], "--question contains '<image>'"),
    (["--question", "<|image_pad|>What?"], "--question contains '<|image_pad|>'"),
    (["--keep", "2"], "argument --keep: keep must be in (0, 1]"),
    (["--layer", "1.7"], "argument --layer: expected an integer, got '1.7'"),
    (["--options", "A) red;B) blue"], "--options (multiple-choice answers) applies to --video"),
    (["--method", "prefixkv", "--parity", "release"], "pass scope='prompt' (command line: a --config file"),
    (["--method", "fastv+debias+debias"], "repeats '+debias'; write it once, e.g. 'fastv+debias'"),
    (["--image", "photo.png", "--frames", "8"], "--frames applies to --video, not to an image (--image)"),
    (["--image", "photo.png", "--gridprobe", "2"], "--gridprobe applies to --video"),
    (["--frames", "4", "--gridprobe", "2"], "--frames, --gridprobe apply to --video"),
]


@pytest.mark.parametrize("argv,words", RUN_CASES, ids=[" ".join(a) for a, _ in RUN_CASES])
def test_run_arguments_are_one_line_before_loading(cli, no_model, argv, words):
    code, _, err = cli("run", "--model", "tiny:llava", *argv)
    assert code == 2 and words in err and _one_line(err), err


def test_video_questions_with_placeholders_are_refused(cli, no_model, tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"x")
    code, _, err = cli("run", "--model", "tiny:qwen2_vl", "--video", str(clip), "--question", "<video> what moves?")
    assert code == 2 and "--question contains '<video>'" in err and _one_line(err), err


def test_the_aspect_limit_applies_only_to_models_that_have_it(cli, no_model, tmp_path):
    from PIL import Image

    path = tmp_path / "wide.png"
    Image.new("RGB", (5000, 20), "red").save(path)
    code, _, err = cli("run", "--model", "tiny:qwen2_vl", "--image", str(path))
    assert code == 2 and "5000x20, an aspect ratio above 200:1" in err and _one_line(err), err


def test_a_very_wide_image_is_answered_on_llava(cli, tmp_path):
    from PIL import Image

    path = tmp_path / "wide.png"
    Image.new("RGB", (5000, 20), "red").save(path)
    code, out, err = cli("run", "--model", "embedded:llava", "--device", "cpu", "--image", str(path), "--question",
                         "What color is the circle?", "--json")
    assert code == 0, err
    assert json.loads(out)["visual_tokens"] > 0


BENCH_LONG_CASES = [
    (["--k", "0"], "argument --k: must be between 1 and 16, got 0"),
    (["--clips", "0"], "argument --clips: must be >= 1, got 0"),
    (["--clips", "-3"], "argument --clips: must be >= 1, got -3"),
    (["--keep", "abc"], "argument --keep: expected a fraction in (0, 1], got 'abc'"),
    (["--keep", ""], "argument --keep: expected comma-separated keep fractions"),
    (["--keep", "0.5,1"], "keep fractions must be below 1"),
    (["--frames", "abc"], "argument --frames: expected an integer, got 'abc'"),
    (["--frames", "100000"], "argument --frames: must be between 0 and 256"),
    (["--setting", "multi", "--sets", "0"], "argument --sets: must be >= 1, got 0"),
    (["--setting", "multi", "--images", "0"], "argument --images: must be between 1 and 16"),
    (["--threads", "-2"], "argument --threads: must be >= 1, got -2"),
    (["--methods", "fastv,nope"], "unknown method 'nope'"),
    (["--methods", "temporal@nope"], "unknown method 'nope'"),
    (["--setting", "multi", "--methods", "gridprobe"], "gridprobe selects video frames"),
    (["--split", "holdout"], "argument --split: invalid choice"),
    (["--debias-file", "missing.json"], "no such calibration file"),
]


@pytest.mark.parametrize("argv,words", BENCH_LONG_CASES, ids=[" ".join(a) for a, _ in BENCH_LONG_CASES])
def test_bench_long_arguments_are_one_line_before_loading(no_model, tmp_path, capsys, argv, words):
    from vtprune.eval.accuracy.long import main

    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and _one_line(err), err
    assert not (tmp_path / "out").exists()


def test_bench_long_resume_names_a_broken_journal(tmp_path):
    from vtprune.eval.accuracy.long_resume import resumed_records

    journal = tmp_path / "records.jsonl"
    journal.write_text('{"item": 0, "question": "q0", "method": "none", "keep": 1.0}\n\n'
                       '{"item": 3, "question": "q3", "method": "fastv", "keep": 0.25}\n')
    assert resumed_records(journal) == {(0, "q0", "none", 1.0), (3, "q3", "fastv", 0.25)}
    journal.write_text('{"item": 0, "question": "q0", "method": "none", "keep": 1.0}\n{"item": 1, "meth')  # killed
    with pytest.raises(UserError, match=r"records.jsonl line 2 is not a bench_long record"):
        resumed_records(journal)
    journal.write_text('{"item": 0, "method": "none"}\n')  # no identity: not a record of this version
    with pytest.raises(UserError, match=r"records.jsonl line 1 is not a bench_long record"):
        resumed_records(journal)


def test_run_reports_the_keep_of_a_kv_retention_method(cli):
    code, out, err = cli("run", "--model", "tiny:llava", "--device", "cpu", "--method", "prefixkv", "--keep", "0.5",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["keep"] == 0.5  # was 1.0: prefixkv has no stages, but every layer keeps 0.5 on average


def test_long_debias_names_a_missing_file_or_field(tmp_path, capsys):
    from vtprune.eval.accuracy.long_debias import main

    assert main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json' does not exist" in capsys.readouterr().err
    thin = tmp_path / "thin.json"
    thin.write_text(json.dumps({"format": "vtprune-debias-calibration", "layers": {"1": {"sigma": 1.0}}}))
    assert main([str(thin)]) == 2
    err = capsys.readouterr().err
    assert "thin.json': field 'method' is missing" in err and _one_line(err), err
    assert main(["docs/results/long-debias/llava-8img-fastv.json"]) == 0


def test_prefixkv_query_rows_beyond_the_prompt_are_every_row():
    model, processor = tiny_model("llava")
    inputs = tiny_inputs(processor, "llava", [("what color is the circle?", [random_image(64, 64, 1)])])
    kept = []
    for rows in (None, 10**9):  # 10**9 rows used to allocate 10**9 query positions
        with vtprune.apply(model, "prefixkv", keep=0.5, query_rows=rows) as handle, torch.no_grad():
            model(**inputs)
            kept.append(handle.last_stats.kept_indices)
    assert kept[0] == kept[1]


def test_a_schedule_for_kv_retention_is_refused_not_ignored():
    """PrefixKV prunes no sequence: a schedule would be silently ignored, so it is refused at wrap time."""
    model, _ = tiny_model("llava")
    with pytest.raises(ValueError, match="takes no schedule"):
        vtprune.wrap(model, "prefixkv", keep=0.5, schedule="2:0.5")


# -- layer indices: integers of any kind, integral numbers; nothing else ------------------------------------------
@pytest.mark.parametrize("layer", [2, 2.0, "np.int64(2)", "np.int32(2)", "np.float32(2.0)", "torch.tensor(2)"])
def test_a_layer_may_be_any_integer_scalar_or_integral_number(layer):
    import numpy as np  # noqa: F401  (the parameters name NumPy and torch scalars)

    value = eval(layer) if isinstance(layer, str) else layer
    assert PruneConfig(method="fastv", keep=0.5, layer=value).stages == PruneConfig(method="fastv", keep=0.5,
                                                                                   layer=2).stages
    model, _ = tiny_model("llava")
    vtprune.wrap(model, "fastv", keep=0.5, layer=value).remove()


@pytest.mark.parametrize("layer", [1.7, "np.float64(1.5)", True, "np.True_", "'2'", float("nan"), "torch.tensor(2.0)"])
def test_a_layer_that_is_not_an_integer_is_refused(layer):
    import numpy as np  # noqa: F401

    value = eval(layer) if isinstance(layer, str) else layer
    with pytest.raises(ValueError, match="must be an integer decoder-layer index"):
        PruneConfig(method="fastv", keep=0.5, layer=value)


def test_a_method_config_file_reads_layers_as_wrap_does(tmp_path):
    from vtprune.method_config import read_method_config

    path = tmp_path / "m.json"
    path.write_text(json.dumps({"method": "fastv", "wrap_options": {"layer": 2.0}}))
    assert read_method_config(str(path)).options["layer"] == 2.0
    path.write_text(json.dumps({"method": "fastv", "wrap_options": {"layer": 2.5}}))
    with pytest.raises(UserError, match=r"field 'wrap_options.layer'.*integer decoder-layer index, got 2.5"):
        read_method_config(str(path))


# -- video runs take the image options -----------------------------------------------------------------------------
def test_video_pruning_takes_rounding_and_parity():
    from vtprune.gridprobe.run import method_config

    config = method_config("fastv", 0.25, "global", rounding="per_image", parity="release", layer=1)
    assert (config.rounding, config.parity, config.options) == ("per_image", "release", {})
    framed = method_config("fastv", 0.25, "per_frame", rounding="per_image")
    assert framed.rounding == "per_image" and framed.options == {"base": "fastv", "base_options": {}}


@pytest.mark.parametrize("extra", [("--rounding", "per_image"), ("--parity", "release")])
def test_vtprune_run_video_with_rounding_or_parity_answers(cli, tmp_path, extra):
    pytest.importorskip("av")
    clip = tmp_path / "clip.mp4"
    assert cli("sample", "--video", str(clip))[0] == 0
    code, out, err = cli("run", "--video", str(clip), "--question", "What color is the circle?", "--frames", "4",
                         "--json", *extra)
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["options"] == {extra[0].removeprefix("--"): extra[1]} and record["answer"]
    assert record["answer_kept_tokens"] < record["answer_visual_tokens"]


def test_demo_errors_name_the_command_that_was_run(cli, capsys):
    """``vtprune demo`` errors read ``vtprune: error:``, ``python demos/app.py`` errors name that script."""
    from vtprune.demo.cli import load_demo_module

    code, _, err = cli("demo", "--model", "/no/such")
    assert code == 2 and err.startswith("vtprune: error: --model '/no/such'") and "demos/app.py" not in err, err
    app = load_demo_module("app")
    with pytest.raises(SystemExit) as stop:
        app.main(["--port", "0"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("python demos/app.py: error: argument --port") and _one_line(err)
    assert app.main(["--model", "/no/such"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python demos/app.py: error: --model '/no/such'") and _one_line(err), err
