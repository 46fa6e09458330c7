"""``vtprune serve``: its refusals and the command line it gives vLLM's OpenAI server (no vLLM needed here)."""

from __future__ import annotations

import json
import shlex


def test_serve_errors_are_one_line(cli, monkeypatch, tmp_path):
    import vtprune.vllm.serve as serve

    code, _, err = cli("serve", "--method", "oracle")
    assert code == 2 and "not available in the vLLM plugin" in err and err.count("\n") == 1
    code, _, err = cli("serve", "--keep", "0")
    assert code == 2 and "outside (0, 1]" in err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"]}))
    code, _, err = cli("serve", str(tmp_path), "--dry-run")
    assert code == 2 and "not supported in vLLM" in err
    monkeypatch.delenv("VTPRUNE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(serve, "VENV_PYTHON", tmp_path / "missing" / "python")
    monkeypatch.setattr(serve, "has_vllm", lambda: False)
    code, _, err = cli("serve")
    assert code == 2 and "bash scripts/setup_vllm.sh" in err and err.count("\n") == 1


def test_serve_command_line(cli):
    code, out, _ = cli("serve", "embedded:qwen2_vl", "--keep", "0.5", "--dry-run", "--max-num-seqs", "4")
    assert code == 0
    words = shlex.split(out)  # the line is shell-quoted: these are the server's argv
    assert "vllm.entrypoints.openai.api_server" in words and "--dtype" in words
    assert words[words.index("--max-num-seqs") + 1] == "4" and words[words.index("--dtype") + 1] == "float32"
    overrides = json.loads(words[words.index("--hf-overrides") + 1])
    assert overrides == {"vtprune": {"method": "divprune", "keep": 0.5, "seed": 0},
                         "architectures": ["VtpruneQwen2VLForConditionalGeneration"]}
    assert "--limit-mm-per-prompt" not in out
    # a top-level vtprune_keep is refused by the server (the middleware), not served at the default keep
    assert words[words.index("--middleware") + 1] == "vtprune.vllm.middleware.RequestKeyCheck"
    code, out, _ = cli("serve", "embedded:qwen2_vl", "--dry-run", "--middleware", "vtprune.vllm.middleware.RequestKeyCheck")
    assert code == 0 and shlex.split(out).count("--middleware") == 1


def test_serve_qwen3_vl_serves_images_and_video(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"]}))
    code, out, _ = cli("serve", str(tmp_path), "--dry-run")
    assert code == 0 and "VtpruneQwen3VLForConditionalGeneration" in out
    assert "--limit-mm-per-prompt" not in out  # vLLM's own limits: images and video
    code, out, _ = cli("serve", str(tmp_path), "--dry-run", "--method", "vflowopt")  # scores images only
    words = shlex.split(out)
    assert code == 0 and json.loads(words[words.index("--limit-mm-per-prompt") + 1]) == {"image": 4, "video": 0}
    code, out, _ = cli("serve", str(tmp_path), "--dry-run", "--method", "vflowopt", "--limit-mm-per-prompt", '{"image": 1}')
    assert out.count("--limit-mm-per-prompt") == 1
