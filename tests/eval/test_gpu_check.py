"""The GPU script's dry run (``scripts/gpu_check.sh --device cpu --quick``) parses, runs and writes its files."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_files(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out",
                           str(out), "--archive", str(tmp_path / "gpu.tar.gz")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with (out / "steps.tsv").open() as f:
        steps = {row["step"]: row["status"] for row in csv.DictReader(f, delimiter="\t")}
    ran = ("speed-llava7b-sdpa", "speed-qwen7b-sdpa", "kernels", "kernel-plots")
    assert all(steps.get(name) == "ok" for name in ran), steps
    assert steps["speed-qwen7b-16384-sdpa"].startswith("skipped") and steps["flash-attn"].startswith("skipped")
    for name in ("speed-llava7b-sdpa", "speed-qwen7b-sdpa"):
        with (out / name / "speed.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert rows and all(r["status"] == "ok" for r in rows)
        assert (out / name / "speedup_vs_keep.png").exists()
    assert (out / "kernels" / "bench_kernels_cpu.csv").exists()
    summary = (out / "summary.md").read_text()
    assert "| speed-llava7b-sdpa | ok |" in summary and "torch:" in summary and "## speed-qwen7b-sdpa" in summary
    assert "torch:" in (out / "conditions.txt").read_text()
    assert (tmp_path / "gpu.tar.gz").stat().st_size > 1000


def test_gpu_check_rejects_a_bad_option():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "tpu"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--device must be cuda or cpu" in done.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--methods", "fastv@x"], "is not a method name or name@K"),
    ([], "holds an earlier run's layerwise.json; pass --force"),
])
def test_vllm_layerwise_script_refuses_before_it_runs(tmp_path, args, says):
    """A malformed name@K, and an --out that holds an earlier run (never overwritten without --force)."""
    (tmp_path / "layerwise.json").write_text("[]\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_vllm_layerwise.py"), "--device", "cpu", "--out",
                           str(tmp_path), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert (tmp_path / "layerwise.json").read_text() == "[]\n"
