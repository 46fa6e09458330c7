"""``vtprune serve --dry-run`` prints one line that a POSIX shell runs as is: the words the shell reads back are
the server's argv word for word (JSON options, paths with spaces or quotes), after the environment variable
``vtprune serve`` sets for vLLM."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from vtprune.vllm import serve


@pytest.fixture
def python(monkeypatch) -> str:
    """The Python the line names (a fixed path: no vLLM lookup on this machine)."""
    path = "/opt/venv vllm/bin/python"
    monkeypatch.setattr(serve, "_dry_run_python", lambda: path)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return path


def _argv(*words: str) -> list[str]:
    """The server's argv for ``vtprune serve WORDS`` (what the real run starts), without the dry run."""
    from vtprune.cli import build_parser, parse_command

    return serve.server_command(parse_command(build_parser(), ["serve", *words]), "/opt/venv vllm/bin/python")


def _shell_words(line: str) -> list[str]:
    """The words ``sh`` makes of ``line`` (quotes removed, nothing expanded that should not be)."""
    script = f'set -- {line}\nfor word in "$@"; do printf "%s\\0" "$word"; done'
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout.split("\0")[:-1]


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my models" / "llava 'v1.5' $HOME"  # spaces, quotes and a $ the shell must not expand
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    return folder


@pytest.mark.parametrize("extra", [
    [], ["--max-num-seqs", "4"], ["--limit-mm-per-prompt", '{"image": 1}'], ["--served-model-name", "a b;c&d"]])
def test_the_printed_line_parses_back_to_the_servers_argv(cli, python, tmp_path, extra):
    folder = str(_folder(tmp_path))
    code, out, err = cli("serve", folder, "--keep", "0.5", "--dry-run", *extra)
    assert code == 0 and err == "" and out.count("\n") == 1, (out, err)
    expected = ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_USE_V2_MODEL_RUNNER=0", *_argv(folder, "--keep", "0.5", *extra)]
    assert shlex.split(out) == expected
    assert _shell_words(out.strip()) == expected  # a real shell reads the same words
    overrides = json.loads(expected[expected.index("--hf-overrides") + 1])
    assert overrides == {"vtprune": {"method": "divprune", "keep": 0.5, "seed": 0},
                         "architectures": ["VtpruneLlavaForConditionalGeneration"]}


def test_an_embedded_model_line_carries_its_defaults(cli, python):
    code, out, _ = cli("serve", "embedded:qwen2_vl", "--keep", "0.5", "--dry-run", "--max-num-seqs", "4")
    words = shlex.split(out)
    env = ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_USE_V2_MODEL_RUNNER=0"]
    assert code == 0 and words == [*env, *_argv("embedded:qwen2_vl", "--keep", "0.5", "--max-num-seqs", "4")]
    assert words[2:5] == [python, "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "4"} <= set(words)


def test_an_environment_variable_the_user_set_is_left_to_the_user(cli, python, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    code, out, _ = cli("serve", "--dry-run")
    words = shlex.split(out)
    assert code == 0 and words[0] == python and not any(w.startswith("VLLM_") for w in words)
    user = {"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert serve.server_env(user) == {}  # the real run keeps the user's values too (V2 is refused at start-up)


def test_a_dry_run_needs_no_free_port_and_no_vllm(cli, monkeypatch):
    monkeypatch.setattr(serve, "check_port", lambda *a: pytest.fail("a dry run checked the port"))
    monkeypatch.setattr(serve, "vllm_python", lambda: (_ for _ in ()).throw(serve.UserError("no vLLM")))
    code, out, _ = cli("serve", "--dry-run")
    assert code == 0 and "vllm.entrypoints.openai.api_server" in shlex.split(out)


@pytest.mark.parametrize("words,needle", [
    (["--method", "fastv", "--layer", "99"], "--layer 99: pruning layer 99 is outside the language model, which has 4"),
    (["--method", "pdrop", "--layer", "4"], "which has 4 decoder layers"),
    (["--method", "temporal"], "'temporal' prunes tokens repeated across video frames"),
    (["embedded:qwen2_vl", "--method", "dart", "--layer", "9"], "--layer 9"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_settings_the_model_cannot_run_are_refused_before_vllm_starts(cli, monkeypatch, words, needle, dry_run):
    """The model's config decides (its decoder layers, its video support), in the dry run too; vLLM never starts
    (``/bin/false`` as its Python would exit 1)."""
    monkeypatch.setenv("VTPRUNE_VLLM_PYTHON", "/bin/false")
    monkeypatch.setattr(serve, "check_port", lambda host, port: None)
    code, out, err = cli("serve", *words, *(["--dry-run"] if dry_run else []))
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1, (out, err)


def test_settings_the_model_can_run_pass(cli, python):
    for words in (["--method", "fastv", "--layer", "3"], ["embedded:qwen2_vl", "--method", "temporal"],
                  ["--method", "pdrop"]):
        code, out, err = cli("serve", *words, "--dry-run")
        assert code == 0 and "api_server" in out, (words, err)


@pytest.mark.parametrize("architecture,method,needle", [
    ("LlavaNextForConditionalGeneration", "visionzip", "recomputes for LLaVA-1.5 and Qwen-VL only"),
    ("LlavaOnevisionForConditionalGeneration", "temporal", "Qwen2-VL / Qwen2.5-VL video only"),
    ("Qwen3VLForConditionalGeneration", "temporal", "Qwen2-VL / Qwen2.5-VL video only"),
])
def test_a_family_without_the_methods_input_is_refused_by_its_architecture(cli, python, tmp_path, architecture, method,
                                                                             needle):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    code, out, err = cli("serve", str(folder), "--method", method, "--dry-run")
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1, err
