"""What a new user meets first: --help with defaults and examples, `vtprune sample`, the embedded models'
vocabulary note, labels that say what ran, and environment errors that come fast and before loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vtprune.cli as vtprune_cli
from vtprune.models.embedded import embedded_model_path


def _subcommands() -> dict:
    parser = vtprune_cli.build_parser()
    return {name: sub for action in parser._subparsers._group_actions for name, sub in action.choices.items()}


def test_every_option_has_help_and_every_command_examples():
    for name, parser in _subcommands().items():
        for action in parser._actions:
            assert action.help, f"vtprune {name} {'/'.join(action.option_strings)} has no help text"
        assert "example" in (parser.epilog or ""), f"vtprune {name} --help shows no example"


@pytest.mark.parametrize("command,shown", [
    ("run", ["default fastv", "default 0.25", "(default: 8)", "(default: sdpa)", "'1:0.5,3:0.25'"]),
    ("bench", ["(default: 100)", "(default: runs/bench)", "(default: 1)"]),
    ("tune", ["(default: 50)", "(default: vflowopt)"]),
    ("sample", ["(default: 0)"]),
])
def test_help_shows_the_defaults(cli, command, shown):
    code, out, _ = cli(command, "--help")
    text = " ".join(out.split())  # argparse wraps lines
    assert code == 0 and all(s in text for s in shown), [s for s in shown if s not in text]
    assert "default: None" not in text


def test_sample_writes_an_image_and_a_clip_the_models_can_answer(tmp_path, cli):
    pytest.importorskip("av", reason="writing a clip needs PyAV, the optional [video] extra (installed by test.sh)")
    from vtprune.media.video import load_video
    from vtprune.shapes.task import make_split
    from vtprune.shapes.video import make_video_split

    image, clip = tmp_path / "shapes.png", tmp_path / "sub" / "clip.mp4"
    code, out, err = cli("sample", "--image", str(image), "--video", str(clip))
    assert code == 0, err
    sample = make_split("test", 1)[0]
    for question in sample.questions:
        assert question.text in out
    import numpy as np
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(image).convert("RGB")), np.asarray(sample.image.convert("RGB")))
    frames = make_video_split("test", 1)[0].frames
    assert len(load_video(clip, 64).frames) == len(frames)
    assert "What color is the" in out and "--gridprobe 4" in out
    code, _, err = cli("sample")
    assert code == 2 and "--image" in err


def test_a_question_outside_the_vocabulary_gets_a_note(cli):
    code, out, _ = cli("run", "--device", "cpu", "--question", "What is on the sofa?", "--json")
    record = json.loads(out)
    assert code == 0 and any("'sofa'" in note and "vtprune-shapes" in note for note in record["notes"])
    code, out, _ = cli("run", "--device", "cpu", "--question", "How many squares are there?", "--json")
    assert code == 0 and not any("vocabulary" in note for note in json.loads(out)["notes"])


def test_run_says_what_it_kept_and_how_it_debiased(cli):
    code, out, _ = cli("run", "--device", "cpu", "--method", "fastv+debias", "--sample", "1")
    assert code == 0
    method_line = next(line for line in out.splitlines() if line.startswith("method"))
    assert "fastv+debias keep=0.25" in method_line and "debias: calibration" in method_line
    assert "calibration.json" in method_line
    code, out, _ = cli("run", "--device", "cpu", "--method", "pdrop", "--keep", "0.5", "--schedule",
                        "1:0.5,3:0.125", "--json")
    record = json.loads(out)
    assert record["keep"] == 0.125 and record["requested_keep"] == 0.5 and record["debias"] is None


def test_keep_label():
    from vtprune.cli.options import keep_label

    assert keep_label(0.25, None, {}) == "keep=0.25"
    assert keep_label(0.125, 0.25, {}) == "keep=0.125 (asked 0.25)"
    assert keep_label(0.0767368, None, {"budget": 0.125}) == "keep=0.0767, average budget 0.125 over the layers"


def test_bench_plan_runs_keep_one_once():
    from vtprune.eval.accuracy.bench import bench_plan

    assert bench_plan(["none", "fastv", "pdrop"], [1.0, 0.25]) == [("none", 1.0), ("fastv", 0.25), ("pdrop", 0.25)]
    assert bench_plan(["fastv"], [1.0, 0.5]) == [("none", 1.0), ("fastv", 0.5)]
    assert bench_plan(["fastv"], [0.5]) == [("fastv", 0.5)]


@pytest.mark.parametrize("argv,words", [
    (["--schedule", "2:0.5,8:0.25"], "--schedule '2:0.5,8:0.25': pruning layer 8 is outside the language model"),
    (["--layer", "9"], "--layer 9: pruning layer 9 is outside"),
    (["--attn", "flash_attention_2"], "needs the package 'flash_attn'"),
])
def test_environment_and_depth_errors_come_before_loading(cli, no_model, argv, words):
    code, _, err = cli("run", *argv)
    assert code == 2 and words in err and "Traceback" not in err, err


def test_a_model_type_vtprune_cannot_prune_is_refused(cli, no_model, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = cli("run", "--model", str(tmp_path))
    assert code == 2 and "'gpt2' model" in err and "qwen2_5_vl" in err


def test_an_unreachable_hub_fails_in_seconds(cli, no_model, monkeypatch, sleeps):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    cpu = time.process_time()
    code, _, err = cli("run", "--model", "someone/not-cached-vlm")
    assert code == 2 and "cannot be reached" in err and "not in the local cache" in err, err
    assert sum(sleeps) < 1 and time.process_time() - cpu < 10  # no network retries with back-off (about 50 s)


def test_a_cached_model_loads_while_the_hub_is_unreachable(tmp_path):
    """A hub id in the cache loads from it (local files only) instead of retrying the network for 50 s."""
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--shapes-llava"
    shutil.copytree(embedded_model_path("llava"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT="http://127.0.0.1:9")
    code = ("import vtprune; m, p = vtprune.load('someone/shapes-llava', device='cpu'); "
            "print(type(m).__name__, p.tokenizer.padding_side)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LlavaForConditionalGeneration", "left"]
    assert "Retrying" not in out.stderr  # huggingface_hub's network retries (about 50 s) never started


def test_import_vtprune_does_not_import_the_applications():
    code = "import sys, vtprune; print('load' in vtprune.__all__, any(m.startswith('vtprune.models') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_quickstart_is_two_commands_and_ends_with_the_activation_step():
    root = Path(__file__).resolve().parents[2]
    readme = root / "README.md"
    block = readme.read_text().split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in block.splitlines() if line.strip()] == ["./quickstart.sh", "./test.sh"]
    script = (root / "quickstart.sh").read_text()
    assert "setup.sh run" in script and "source .venv/bin/activate" in script


def test_parity_release_is_checked_before_loading_and_shown(cli, no_model):
    """``--parity release`` on a method without a release rule fails before any model loads, naming the fix."""
    code, _, err = cli("run", "--method", "random", "--parity", "release")
    assert code == 2 and "--parity release is not available for --method random" in err
    assert "pdrop" in err and "drop --parity" in err


def test_parity_release_runs_and_says_so(cli):
    code, out, _ = cli("run", "--device", "cpu", "--method", "pdrop", "--keep", "0.5", "--parity", "release")
    assert code == 0 and "parity: release" in out
    # pdrop keeps 8 of 16 at its last stage under either rounding rule; the label is what is checked here.
    assert "16 tokens -> 8 kept" in out


def test_handle_repr_says_debias_and_parity():
    import vtprune
    from vtprune.models.tiny import tiny_model

    model, _ = tiny_model("llava")
    with vtprune.apply(model, "pdrop", keep=0.5, parity="release") as handle:
        assert "parity='release'" in repr(handle) and "method='pdrop'" in repr(handle)
    with vtprune.apply(model, "fastv+debias", keep=0.5) as handle:
        assert "debias=True" in repr(handle) and "parity" not in repr(handle)
