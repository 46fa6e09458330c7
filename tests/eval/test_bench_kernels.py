"""Smoke test of the kernel benchmark and plot scripts on tiny CPU shapes."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

from vtprune.eval.kernels import bench as bench_kernels
from vtprune.eval.kernels import plot as plot_kernels


def test_bench_and_plot_write_csv_and_pngs(tmp_path: Path) -> None:
    out = tmp_path / "kernels"
    path = bench_kernels.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--batch",
            "1",
            "3",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == bench_kernels.COLUMNS
        rows = list(reader)
    n_shapes = len(bench_kernels.PRESETS["tiny"]) * 2  # x batches
    per_case = {"topk": 2, "merge": 1, "scoring": 4}  # cpu impls (triton skipped) x scoring variants
    for kernel, n in per_case.items():
        assert sum(r["kernel"] == kernel for r in rows) == n * n_shapes, kernel
    for r in rows:
        p20, p50, p80 = float(r["p20_ms"]), float(r["p50_ms"]), float(r["p80_ms"])
        assert 0 < p20 <= p50 <= p80 and math.isfinite(p80)
        assert r["impl"] != "triton" and r["device"] == "cpu" and "triton skipped" in r["note"]
        assert float(r["max_abs_diff"]) <= 1e-5 and int(r["reps"]) > 0
        assert r["torch_version"] and r["git_sha"] and r["device_name"]
    pngs = plot_kernels.main(["--out", str(out)])
    assert sorted(p.name for p in pngs) == ["kernels_merge.png", "kernels_scoring.png", "kernels_topk.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_module_cli_runs(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "vtprune.eval.kernels.bench", "--quick", "--device", "cpu", "--preset", "tiny",
           "--batch", "1", "--kernels", "topk", "--threads", "1", "--out", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "bench_kernels_cpu.csv").exists()
    table = [line for line in res.stdout.splitlines() if line.startswith("| topk |")]  # a summary, not only a path
    assert table and "torch p50 ms" in res.stdout and "torch_loop p50 ms" in res.stdout
