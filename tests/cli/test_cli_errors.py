"""Command-line arguments: clear one-line errors before any work or model loading; bugs keep tracebacks."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import vtprune.cli as vtprune_cli
from vtprune.errors import UserError


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, cli):
    def command(error):
        def run(args):
            raise error
        return run

    parser = vtprune_cli.build_parser()
    for error, shown in ((UserError("bad value x; use y."), "bad value x; use y."),
                         (FileNotFoundError("no file f"), "no file f"),
                         (ModuleNotFoundError("No module named 'optuna'", name="optuna"),
                          'pip install -c constraints.txt -e ".[bench]"')):
        monkeypatch.setattr(vtprune_cli, "build_parser", lambda e=error: _with_command(parser, command(e)))
        code, _, err = cli("info")
        assert code == 2 and err.strip() == err.strip().splitlines()[0] and shown in err, err
    for bug in (RuntimeError("shape mismatch"), KeyError("x"), ValueError("from torch")):  # not raised by vtprune
        monkeypatch.setattr(vtprune_cli, "build_parser", lambda e=bug: _with_command(parser, command(e)))
        with pytest.raises(type(bug)):
            vtprune_cli.main(["info"])
    monkeypatch.setenv("VTPRUNE_TRACEBACK", "1")
    monkeypatch.setattr(vtprune_cli, "build_parser", lambda: _with_command(parser, command(UserError("shown in full"))))
    with pytest.raises(UserError):
        vtprune_cli.main(["info"])


def _with_command(parser, func):
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


RUN_CASES = [
    (["--sample", "100000"], "--sample: must be between 0 and 9999"),
    (["--keep", "nan"], "keep must be in (0, 1]"),
    (["--keep", "0"], "keep must be in (0, 1]"),
    (["--layer", "-1"], "--layer: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be between 1"),
    (["--attn", "magic"], "--attn: invalid choice: 'magic'"),
    (["--dtype", "float8"], "--dtype: invalid choice"),
    (["--device", "cuda"], "CUDA is not available here"),
    (["--device", "tpu9"], "is not a device"),
    (["--model", "/no/such/folder"], "no such folder"),
    (["--model", "tiny:llama"], "no tiny model of that type"),
    (["--model", "embedded:gpt"], "no embedded model 'gpt'"),
    (["--model", "README.md"], "is not a model folder"),
    (["--method", "nope"], "known methods"),
    (["--method", "random", "--debias", "true"], "debias does not apply"),
    (["--schedule", "2-0.5"], "LAYER:KEEP"),
    (["--schedule", "2:0.5,1:0.25"], "schedule layers must increase strictly"),
    (["--question", "  "], "--question is empty"),
]


@pytest.mark.parametrize("argv,words", RUN_CASES, ids=[" ".join(a) for a, _ in RUN_CASES])
def test_run_arguments_fail_before_loading(cli, no_model, argv, words):
    code, _, err = cli("run", "--model", "tiny:llava", *argv)
    assert code == 2 and words in err and "Traceback" not in err, err


def test_offline_hub_id_fails_fast(cli, no_model, monkeypatch, sleeps):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cpu = time.process_time()
    code, _, err = cli("run", "--model", "someone/not-cached-vlm")
    assert code == 2 and "not in the local Hugging Face cache" in err
    assert sum(sleeps) < 1 and time.process_time() - cpu < 10  # no retries with back-off, no heavy work


def test_sample_index_is_generated_alone(monkeypatch):
    import vtprune.shapes.task as task

    image, question, answer = vtprune_cli._sample(7)
    reference = task.make_split("test", 8)[7]
    assert image.tobytes() == reference.image.tobytes() and question == reference.questions[0].text
    generated = []  # counted, not timed: a loaded machine must not fail this
    real = task.generate_image_sample
    monkeypatch.setattr(task, "generate_image_sample", lambda seed, index, *a: generated.append(index) or
                        real(seed, index, *a))
    vtprune_cli._sample(9_999)
    assert generated == [9_999]


def test_over_long_questions_are_refused(cli, monkeypatch):
    code, _, err = cli("run", "--model", "embedded:llava", "--device", "cpu", "--question", "why " * 12_500)
    assert code == 2 and "past the model's context of 512 positions" in err and "Traceback" not in err, err
    from vtprune.models.pipeline import check_prompt_length
    from vtprune.models.tiny import tiny_model

    model, _ = tiny_model("llava")
    limit = model.config.text_config.max_position_embeddings
    check_prompt_length(model, torch.zeros(1, limit // 2, dtype=torch.long), 8)
    with pytest.warns(UserWarning, match=f"of the model's {limit} positions"):
        check_prompt_length(model, torch.zeros(1, limit - 20, dtype=torch.long), 8)
    with pytest.raises(UserError, match="Shorten the question"):
        check_prompt_length(model, torch.zeros(1, limit - 4, dtype=torch.long), 8)


BENCH_CASES = [
    (["--keep", ""], "--keep: expected comma-separated keep fractions"),
    (["--keep", "0.5,2"], "keep must be in (0, 1]"),
    (["--methods", ","], "--methods: expected comma-separated names"),
    (["--methods", "nope"], "unknown method 'nope'"),
    (["--images", "0"], "--images: must be between 1"),
    (["--batch-size", "0"], "--batch-size: must be between 1"),
    (["--timing-samples", "0"], "--timing-samples: must be between 1"),
    (["--split", "holdout"], "--split: invalid choice"),
    (["--video", "--clips", "0"], "--clips: must be between 1"),
    (["--video", "--probe-pixels", "0"], "--probe-pixels: must be between 784"),
    (["--device", "cuda"], "CUDA is not available"),
]


@pytest.mark.parametrize("argv,words", BENCH_CASES, ids=[" ".join(a) for a, _ in BENCH_CASES])
def test_bench_arguments_fail_before_loading(cli, no_model, tmp_path, argv, words):
    code, _, err = cli("bench", "--model", "tiny:llava", "--out", str(tmp_path / "out"), *argv)
    assert code == 2 and words in err and "Traceback" not in err, err


def test_output_paths_are_checked_before_any_work(cli, no_model, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        (["bench", "--out", str(a_file)], "is a file; give a folder"),
        (["bench", "--out", str(a_file / "sub")], "is a file, so no folder can be created"),
        (["tune", "--out", str(tmp_path)], "is a folder; give a file path"),
        (["tune", "--out", str(a_file / "tuned.json")], "is a file, so no folder can be created"),
        (["tune", "--out", str(tmp_path / "t.json"), "--n-samples", "0"], "--n-samples: must be between 1"),
        (["tune", "--out", str(tmp_path / "t.json"), "--batch-size", "0"], "--batch-size: must be between 1"),
        (["tune", "--out", str(tmp_path / "t.json"), "--budget", "0"], "keep must be in (0, 1]"),
        (["tune", "--out", str(tmp_path / "t.json"), "--method", "nope"], "known methods"),
        (["calibrate", "--out", str(tmp_path)], "is a folder; give a file path"),
        (["calibrate", "--out", str(a_file / "cal.json")], "is a file, so no folder can be created"),
        (["calibrate", "--out", str(tmp_path / "c.json"), "--method", "random"], "calibration covers"),
        (["calibrate", "--out", str(tmp_path / "c.json"), "--data", str(a_file)], "is not a folder of images"),
    ]
    for argv, words in cases:
        code, _, err = cli(*argv, "--model", "tiny:llava")
        assert code == 2 and words in err and "Traceback" not in err, (argv, err)


def test_demo_refuses_a_busy_port_and_warns_beyond_loopback(capsys, monkeypatch, cli):
    from vtprune.cli.checks import exposure_warning, is_loopback
    from vtprune.demo.cli import load_demo_module

    app = load_demo_module("app")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = cli("demo", "--port", str(port), "--model", "tiny:llava")
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err, err
    code, _, err = cli("demo", "--port", "0")
    assert code == 2 and "--port" in err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and exposure_warning("127.0.0.1", False) is None
    assert "no authentication" in exposure_warning("0.0.0.0", False)
    assert "gradio.live" in exposure_warning("127.0.0.1", True)
    monkeypatch.setattr(app, "build_app", lambda *a, **k: "app")
    monkeypatch.setattr(app, "launch", lambda *a, **k: None)
    assert app.main(["--host", "0.0.0.0", "--port", str(_free_port()), "--model", "tiny:llava"]) == 0
    assert "WARNING: the demo has no authentication" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_demo_reports_a_fake_video_as_a_bad_file(tmp_path):
    from vtprune.demo.app import UploadError, check_upload
    from vtprune.demo.cli import load_demo_module

    fake = tmp_path / "clip.mp4"
    fake.write_text("not a video\n" * 50)
    with pytest.raises(UploadError, match="clip.mp4 is not a readable video"):
        check_upload(fake, [tmp_path])
    app = load_demo_module("app")
    app_roots = app.upload_roots
    try:
        app.upload_roots = lambda: [str(tmp_path)]
        outputs = dict(zip(app.OUTPUTS, app.on_run(None, str(fake), "Which?", "fastv", 0.25, False, 3), strict=True))
    finally:
        app.upload_roots = app_roots
    assert outputs["status"] == "⚠️ Cannot run: clip.mp4 is not a readable video (its data is not a video container)."


def test_lmms_model_args_check_model_and_device_before_loading(monkeypatch):
    from vtprune.eval.lmms_plugin.args import parse_model_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no such folder"):
        parse_model_args({"pretrained": "/no/such/model"})
    with pytest.raises(UserError, match="CUDA is not available"):
        parse_model_args({"device": "cuda"})


def test_demo_refuses_an_over_long_question_with_a_message():
    from vtprune.demo.app import EXAMPLES_DIR, DemoRunner
    from vtprune.demo.cli import load_demo_module
    from vtprune.shapes.task import make_split

    app = load_demo_module("app")
    runner = DemoRunner("embedded:llava", device="cpu", timing_repeats=0)
    with pytest.raises(UserError, match="past the model's context of 512 positions"):
        runner.compare(make_split("test", 1)[0].image, "why " * 12_500, "fastv", 0.25)
    path = app.write_examples()[0][0]
    app_roots = app.upload_roots
    try:
        app.upload_roots = lambda: [str(EXAMPLES_DIR)]
        outputs = dict(zip(app.OUTPUTS, app.on_run(runner, path, "why " * 12_500, "fastv", 0.25, False, 3),
                           strict=True))
    finally:
        app.upload_roots = app_roots
    assert outputs["status"].startswith("⚠️ Cannot run: the question's prompt is") and "Shorten" in outputs["status"]
