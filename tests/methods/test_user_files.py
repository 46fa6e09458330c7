"""Files the user gives (method configs, debias calibrations): validated at load time, errors name file and field."""

from __future__ import annotations

import copy
import json
import re

import pytest

from vtprune.errors import UserError
from vtprune.method_config import load_method_config, read_method_config

SHIPPED = "vtprune/models/vtprune-llava-shapes/calibration.json"

CONFIGS = {
    "not json": ("{oops", "is not valid JSON: Expecting property name"),
    "a list": ("[1, 2]", "must hold a JSON object"),
    "wrap_options a list": ({"method": "vflowopt", "wrap_options": [1]}, "field 'wrap_options' must be a JSON object"),
    "NaN": ('{"method": "transprune", "wrap_options": {"alpha": NaN}}', "field 'wrap_options.alpha' is nan"),
    "Infinity": ('{"method": "vflowopt", "wrap_options": {"r1": Infinity}}', "field 'wrap_options.r1' is inf"),
    "string number": ({"method": "transprune", "wrap_options": {"alpha": "high"}}, "'wrap_options.alpha' of transprune"),
    "keep above 1": ({"keep": 1.5}, "field 'keep': keep must be in (0, 1]"),
    "keep a string": ({"keep": "0.5"}, "field 'keep' must be a number"),
    "unsorted schedule": ({"schedule": "8:0.5,2:0.25"}, "field 'schedule': schedule layers must increase"),
    "growing schedule": ({"schedule": [[2, 0.25], [8, 0.5]]}, "field 'schedule': keep must not grow"),
    "negative layer": ({"layer": -1}, "field 'layer' must be a decoder layer index"),
    "layer and schedule": ({"layer": 2, "schedule": "3:0.5"}, "'layer' and 'schedule' are both set"),
    "unknown method": ({"method": "nope", "wrap_options": {}}, "field 'method' must be one of"),
    "unknown option": ({"method": "fastv", "wrap_options": {"alpah": 1}}, "'wrap_options.alpah' is not an option of fastv"),
    "missing calibration": ({"method": "fastv", "wrap_options": {"debias": "nofile.json"}}, "'wrap_options.debias'"),
    "two methods": ({"method": "fastv", "wrap_options": {"method": "pdrop"}}, "disagree"),
    "bad positions": ({"positions": "left"}, "field 'positions' must be 'original' or 'compact'"),
}


def _write(tmp_path, name: str, content) -> str:
    path = tmp_path / (re.sub(r"\W+", "_", name) + ".json")
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_malformed_method_configs_name_the_file_and_field(tmp_path, case):
    content, words = CONFIGS[case]
    path = _write(tmp_path, case, content)
    with pytest.raises(UserError) as error:
        load_method_config(path)
    assert path in str(error.value) and words in str(error.value), str(error.value)


def test_method_config_paths_and_a_good_file(tmp_path):
    for path, words in ((tmp_path / "missing.json", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(UserError, match=words):
            load_method_config(str(path))
    path = _write(tmp_path, "ok", {"method": "vflowopt", "budget": 0.25, "wrap_options": {"budget": 0.25, "r1": 0.5}})
    loaded = read_method_config(path)
    assert loaded.method == "vflowopt" and loaded.options == {"budget": 0.25, "r1": 0.5}


def _calibration(tmp_path, name: str, edit) -> str:
    data = json.loads(open(SHIPPED).read())
    data = copy.deepcopy(data)
    edit(data)
    return _write(tmp_path, "cal " + name, data)


CALIBRATIONS = {
    "NaN sigma": (lambda d: d["layers"]["1"].__setitem__("sigma", float("nan")), "'layers.1.sigma' must be a finite"),
    "huge sigma": (lambda d: d["layers"]["1"].__setitem__("sigma", 1e6), "'layers.1.sigma' is 1000000.0, beyond"),
    "string sigma": (lambda d: d["layers"]["1"].__setitem__("sigma", "1.2"), "'layers.1.sigma' must be a finite"),
    "missing sigma": (lambda d: d["layers"]["1"].pop("sigma"), "'layers.1.sigma' is missing"),
    "negative mu": (lambda d: d["layers"]["1"].__setitem__("mu", -1), "'layers.1.mu' must be a finite number > 0"),
    "unsorted curve": (lambda d: d["layers"]["2"]["curve"]["x"].reverse(), "'layers.2.curve.x' must increase"),
    "short curve": (lambda d: d["layers"]["2"]["curve"]["mean"].pop(), "'x' has 16 values but 'mean' has 15"),
    "layers a list": (lambda d: d.__setitem__("layers", [1, 2]), "field 'layers' must be a non-empty object"),
    "layer name": (lambda d: d["layers"].__setitem__("first", {"sigma": 1.0}), "'layers.first' must be keyed"),
    "tau": (lambda d: d.__setitem__("tau", 5), "field 'tau' must be a number in [0, 1]"),
    "trend": (lambda d: d.__setitem__("trend", "linear"), "field 'trend' must be one of exp, curve"),
}


@pytest.mark.parametrize("case", sorted(CALIBRATIONS))
def test_malformed_calibrations_fail_at_load_time(tmp_path, case):
    from vtprune.methods.debias import check_debias_option, read_calibration

    edit, words = CALIBRATIONS[case]
    path = _calibration(tmp_path, case, edit)
    for load in (read_calibration, check_debias_option):
        with pytest.raises(UserError) as error:
            load(path)
        assert path in str(error.value) and words in str(error.value), str(error.value)
    assert read_calibration(SHIPPED).layers  # the shipped file passes the same checks






def test_cli_config_conflicts_fail_before_loading(tmp_path, cli, no_model):
    tuned = _write(tmp_path, "tuned", {"method": "pdrop", "wrap_options": {"schedule": "1:0.5,3:0.25"}})
    keeps = _write(tmp_path, "keeps", {"keep": 0.5})
    cases = [
        (["--config", tuned, "--method", "fastv"], "--method 'fastv' but --config"),
        (["--config", keeps, "--keep", "0.25"], "--keep 0.25 but --config"),
        (["--config", tuned, "--layer", "2"], "sets a schedule and the command line a layer"),
        (["--config", tuned, "--schedule", "2:0.5"], "--schedule '2:0.5' but --config"),
        (["--config", _write(tmp_path, "bad", {"keep": 2})], "field 'keep'"),
        (["--debias", str(tmp_path / "nope.json")], "no such calibration file"),
    ]
    for argv, words in cases:
        code, _, err = cli("run", "--model", "tiny:llava", "--device", "cpu", *argv)
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)


def test_cli_config_supplies_method_and_keep(tmp_path, cli):
    config = _write(tmp_path, "pdrop", {"method": "pdrop", "wrap_options": {"keep": 0.5, "layer": 2}})
    code, out, _ = cli("run", "--model", "tiny:llava", "--device", "cpu", "--config", config, "--json")
    record = json.loads(out)
    assert code == 0 and record["method"] == "pdrop" and record["keep"] == 0.5 and record["stages"] == [[2, 0.5]]


def test_run_json_reports_the_effective_keep_and_stages(cli):
    code, out, _ = cli("run", "--model", "tiny:llava", "--device", "cpu", "--keep", "0.5",
                        "--schedule", "1:0.5,3:0.25", "--json")
    record = json.loads(out)
    assert code == 0 and record["keep"] == 0.25 and record["requested_keep"] == 0.5
    assert record["stages"] == [[1, 0.5], [3, 0.25]] and record["stage_layers"] == [1, 3]
    assert record["kept_tokens"] == round(0.25 * record["visual_tokens"])
    assert any("overridden by the schedule" in note for note in record["notes"])


def test_lmms_config_file_is_checked_and_clashes_refused(tmp_path):
    from vtprune.eval.lmms_plugin.args import parse_model_args

    tuned = _write(tmp_path, "tuned", {"method": "pdrop", "wrap_options": {"schedule": "1:0.5;3:0.25"}})
    args = parse_model_args({"config": tuned})
    assert args.prune.method == "pdrop" and [s.keep for s in args.prune.stages] == [0.5, 0.25]
    with pytest.raises(UserError, match="method='fastv' but config="):
        parse_model_args({"config": tuned, "method": "fastv"})
    with pytest.raises(UserError, match="field 'wrap_options.alpha' is nan"):
        parse_model_args({"config": _write(tmp_path, "nan", '{"method": "transprune", "wrap_options": {"alpha": NaN}}')})


def test_calibrate_data_rows_and_images_are_checked_before_loading(tmp_path, cli, no_model):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "questions.jsonl").write_text('{"image": "a.png", "question": "q"}\n{"image": 3}\n')
    out = str(tmp_path / "cal.json")
    code, _, err = cli("calibrate", "--data", str(folder), "--out", out, "--model", "tiny:llava")
    assert code == 2 and "questions.jsonl line 1" not in err and "line 2" in err, err
    (folder / "questions.jsonl").write_text('{"image": "a.png"}\n')
    (folder / "a.png").write_bytes(b"")
    code, _, err = cli("calibrate", "--data", str(folder), "--out", out, "--model", "tiny:llava")
    assert code == 2 and "empty (0 bytes)" in err, err
