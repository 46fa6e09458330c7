"""The CLI and the benchmark end to end on small slices (tiny random model and the embedded model), in this
process (the ``cli`` fixture); one check runs ``python -m vtprune.cli`` in a fresh interpreter."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
from vtprune.eval.accuracy.bench import evaluate, load_items

import vtprune

CLI = [sys.executable, "-m", "vtprune.cli"]


def test_run_json_reports_what_was_kept(cli):
    code, out, err = cli("run", "--model", "tiny:llava", "--method", "fastv", "--keep", "0.25", "--json")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert {"answer", "method", "keep", "visual_tokens", "kept_tokens", "prefill_ms", "kept_indices"} <= set(record)
    assert record["kept_tokens"] == vtprune.keep_count(0.25, record["visual_tokens"])
    assert len(record["kept_indices"][0]) == record["kept_tokens"]
    assert record["prefill_ms"] > 0


def test_run_bad_value_is_a_clear_error(cli):
    """``python -m vtprune.cli`` in a fresh interpreter: exit status 2 and one line, no traceback."""
    out = subprocess.run([*CLI, "run", "--model", "tiny:llava", "--method", "fastv", "--keep", "1.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "keep must be in (0, 1]" in out.stderr and "Traceback" not in out.stderr
    code, _, err = cli("run", "--model", "tiny:llava", "--method", "nope")
    assert code == 2 and "known methods" in err


def test_info_lists_models_and_methods(cli):
    code, out, _ = cli("info")
    assert code == 0 and "qwen2_5_vl" in out and "fastv" in out


def test_bench_writes_a_well_formed_csv_table_and_plots(tmp_path, cli):
    code, out, err = cli("bench", "--model", "tiny:llava", "--images", "2", "--methods", "none,fastv,oracle",
                         "--keep", "1,0.25", "--timing-samples", "1", "--repeats", "1", "--out", str(tmp_path))
    assert code == 0, err
    assert "| method | keep |" in out and "Columns:" in out  # the table is printed, with its legend
    with (tmp_path / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["method"], float(r["keep"])) for r in rows} == {("none", 1.0), ("fastv", 0.25), ("oracle", 0.25)}
    required = {"accuracy", "evidence_recall", "kept_per_stage", "prefill_gflops", "kv_cache_bytes",
                "prefill_ms_p20", "prefill_ms_p50", "prefill_ms_p80", "decode_ms_p50", "device", "dtype",
                "attn_implementation", "batch_size", "torch", "transformers", "git_sha"}
    assert required <= set(rows[0])
    overall = {(r["method"], float(r["keep"])): r for r in rows if r["qtype"] == "all"}
    assert float(overall[("none", 1.0)]["evidence_recall"]) == 1.0
    assert float(overall[("fastv", 0.25)]["flops_ratio"]) < 1.0
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert (tmp_path / "bench.md").read_text().startswith("| method |")
    assert (tmp_path / "accuracy_recall_vs_keep.png").stat().st_size > 1000


def test_oracle_recall_is_one_when_the_budget_covers_the_evidence():
    from vtprune.models.tiny import tiny_model

    model, processor = tiny_model("llava", image_size=112)
    items = load_items("test", 3)
    records = evaluate(model, processor, items, "oracle", 0.5, batch_size=6)
    budget = vtprune.keep_count(0.5, 64)
    covered = [r for r in records if r["recall"] == r["recall"]]
    assert covered, "the slice has questions with evidence"
    for record in covered:
        assert record["kept"] == [budget]
        assert record["recall"] == pytest.approx(1.0)


def test_speed_proxy_runs_and_reports_overhead(tmp_path, cli):
    code, _, err = cli("bench", "--speed", "--methods", "fastv", "--keep", "0.25", "--speed-tokens", "576",
                       "--speed-hidden", "128", "--speed-layers", "4", "--repeats", "1", "--speed-batches", "1",
                       "--speed-new-tokens", "2", "--speed-memory", "off", "--speed-syncs", "off", "--out", str(tmp_path))
    assert code == 0, err
    with (tmp_path / "speed.csv").open() as f:
        row = [r for r in csv.DictReader(f) if r["method"] == "fastv" and float(r["keep"]) == 0.25][0]
    assert float(row["predicted_prefill"]) > 1.0 and float(row["speedup_prefill"]) > 0
    assert torch.isfinite(torch.tensor(float(row["hook_overhead_pct"])))


def test_dense_task_items_for_the_64_token_model():
    """``--task auto`` picks the dense version for embedded:llava64 only; its items are 224 px with where3."""
    from vtprune.eval.accuracy.bench import task_for

    assert task_for("embedded:llava64", "auto") == "dense" and task_for(None, "auto") == "shapes"
    assert task_for("embedded:llava", "auto") == "shapes" and task_for("embedded:llava", "dense") == "dense"
    items = load_items("test", 2, "dense")
    assert {item.image.size for item in items} == {(224, 224)}
    assert "where3" in {item.qtype for item in items} and "where" not in {item.qtype for item in items}
