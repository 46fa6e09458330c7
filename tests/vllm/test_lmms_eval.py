"""lmms-eval through vLLM with the plugin: lmms-eval's own `vllm` model, hf_overrides in --model_args, on the
local vtprune_shapes task (8 questions, the embedded Qwen2-VL with FastV inside the language model, keep 0.25).
No time limit of its own: a loaded machine may take many minutes to start an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lmms_eval", reason="scripts/setup_vllm.sh installs lmms-eval into the vLLM venv")

LIMIT = 8


def test_lmms_eval_vllm_model_with_the_plugin(tmp_path):
    from vtprune.eval.lmms_plugin.prepare import prepare

    from vtprune.vllm.export import model_folder

    tasks = prepare(tmp_path / "tasks", n_images=LIMIT)
    overrides = {"architectures": ["VtpruneQwen2VLForConditionalGeneration"],
                 "vtprune": {"method": "fastv", "keep": 0.25}}
    model_args = (f"model={model_folder('embedded:qwen2_vl')},hf_overrides={json.dumps(overrides)},dtype=float32,"
                  "enforce_eager=True,max_model_len=512,max_new_tokens=4")
    command = [sys.executable, "-m", "lmms_eval", "--model", "vllm", "--model_args", model_args,
               "--tasks", "vtprune_shapes", "--include_path", str(tasks), "--limit", str(LIMIT),
               "--output_path", str(tmp_path / "out"), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1")
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(next((tmp_path / "out").rglob("*_results.json")).read_text())
    samples = next((tmp_path / "out").rglob("*_samples_vtprune_shapes.jsonl")).read_text().splitlines()
    assert len(samples) == LIMIT
    # the embedded Qwen2-VL answers most questions with FastV at keep 0.25; garbage would score ~0
    assert results["results"]["vtprune_shapes"]["exact_match,none"] >= 0.5
