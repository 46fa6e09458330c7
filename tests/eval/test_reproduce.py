"""``vtprune bench reproduce``: the papers' numbers, the lmms-eval runs that reproduce them, the table.

The dry run (embedded models, local ``vtprune_shapes`` task, CPU) goes through the whole pipeline in 40-60
s; the GPU commands are checked against lmms-eval's own parser and task index.
"""

from __future__ import annotations

import csv
import json
import shlex
import sys
from pathlib import Path

import pytest
from vtprune.eval.papers import reproduce
from vtprune.eval.papers.reproduce import BENCHMARKS, RELATIVE, PaperRow, Setting, load_papers
from vtprune.eval.papers.table import measured

PAPERS_IN_ISSUE = {"fastv", "pdrop", "visionzip", "divprune", "dart", "transprune"}


def test_data_file_cites_a_source_for_every_number() -> None:
    rows = load_papers()
    assert PAPERS_IN_ISSUE <= {r.method for r in rows if r.value is not None and r.keep is not None}
    for row in rows:
        assert "arXiv:" in row.source or "Table" in row.source, row
        assert row.value is not None or row.note, f"an empty number needs a note saying why: {row}"
        assert row.keep is not None or row.note, f"a row that cannot run needs a note saying why: {row}"
    assert {r.model for r in rows} == {"llava-1.5-7b", "qwen2.5-vl-7b"}


def test_plan_runs_each_setting_once_plus_the_unpruned_reference() -> None:
    runs = reproduce.plan(load_papers())
    llava = {s: t for s, t in runs.items() if s.model == "llava-1.5-7b"}
    assert Setting("llava-1.5-7b", "none", 1.0) in llava and Setting("llava-1.5-7b", "dart", 0.111111) in llava
    assert set(llava[Setting("llava-1.5-7b", "none", 1.0)]) == set().union(*llava.values())
    assert runs[Setting("qwen2.5-vl-7b", "visionzip", 0.2)] == sorted({BENCHMARKS[b].task for b in RELATIVE["REL5"]})
    assert not any(s.method == "transprune" for s in runs if s.model == "qwen2.5-vl-7b")  # keep not released


def test_metrics_are_on_the_papers_scale_and_relative_scores_use_the_same_model() -> None:
    file = {"results": {"mme": {"mme_perception_score,none": 1500.0, "mme_cognition_score,none": 350.0},
                        "pope": {"pope_f1_score,none": 0.85}, "gqa": {"exact_match,none": 0.6},
                        "mmbench_en_dev": {"gpt_eval_score,none": 64.0}, "textvqa_val": {"exact_match,none": 0.5}}}
    assert reproduce.metric(file, "MME", False) == 1850.0 and reproduce.metric(file, "MME-P", False) == 1500.0
    assert reproduce.metric(file, "POPE", False) == pytest.approx(85.0)
    assert reproduce.metric(file, "SQA-IMG", False) is None  # task not in the file: no number, not a zero
    half = {"results": {task: {k: v / 2 for k, v in values.items()} for task, values in file["results"].items()}}
    runs = {Setting("m", "none", 1.0): {"results": file}, Setting("m", "x", 0.2): {"results": half}}
    row = PaperRow("p", "m", "x", 0.2, "", "REL5", 90.0, "s", "")
    assert measured(row, runs, False) == pytest.approx(50.0)


def test_a_local_checkpoint_replaces_the_hub_id(tmp_path: Path, capsys) -> None:
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text("{}")
    assert reproduce.main(["--print-commands", "--models", "llava-1.5-7b", "--methods", "dart",
                           "--checkpoint", f"llava-1.5-7b={tmp_path / 'llava'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(f"pretrained={tmp_path / 'llava'}," in line for line in lines)
    with pytest.raises(SystemExit):
        reproduce.main(["--print-commands", "--checkpoint", f"llava-1.5-7b={tmp_path}"])  # no config.json
    assert "holds no config.json" in capsys.readouterr().err


def test_a_run_without_results_file_is_an_error(tmp_path: Path) -> None:
    """lmms-eval logs its errors and exits 0, so the missing results file must stop the script."""
    with pytest.raises(RuntimeError, match="wrote no results"):
        reproduce.run_subprocess(["--model", "x"], tmp_path / "run", [sys.executable, "-c", "pass"])


def test_gpu_commands_parse_with_lmms_eval_and_name_its_tasks(capsys) -> None:
    from lmms_eval.__main__ import parse_eval_args
    from lmms_eval.tasks import TaskManager

    assert reproduce.main(["--print-commands", "--launcher", "accelerate launch --num_processes 8"]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert len(commands) == len(reproduce.plan(load_papers()))
    known = set(TaskManager().all_tasks)
    for words in commands:
        assert words[:4] == ["accelerate", "launch", "--num_processes", "8"] and words[4:6] == ["-m", "lmms_eval"]
        argv, sys.argv = sys.argv, ["lmms_eval", *words[6:]]
        try:
            _, args = parse_eval_args()
        finally:
            sys.argv = argv
        assert set(args.tasks.split(",")) <= known, args.tasks
        assert "pretrained=llava-hf/" in args.model_args or "pretrained=Qwen/" in args.model_args


@pytest.mark.slow
def test_dry_run_writes_the_table_with_the_papers_columns(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert reproduce.main(["--dry-run", "--limit", "4", "--batch-size", "8", "--out", str(tmp_path)]) == 0
    lines = list(csv.DictReader(open(tmp_path / "table.csv")))
    rows = load_papers()
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        assert line["paper_value"] == ("" if row.value is None else str(row.value))
        if row.keep is None:
            assert line["measured"] == "" and line["wall_s"] == ""
            continue
        assert float(line["wall_s"]) > 0 and float(line["generate_s"]) > 0 and line["measured"] != ""
        if row.method != "none":
            assert float(line["prefill_ms_per_sample"]) > 0 and float(line["generate_speedup"]) > 0
        if row.value is not None:
            assert float(line["difference"]) == pytest.approx(float(line["measured"]) - row.value)
        assert line["mode"] == "dry run" and line["git_sha"]
    fastv = next(x for x in lines if x["method"] == "fastv" and x["keep"] == "0.5")
    assert float(fastv["kept_tokens"]) == 8 and float(fastv["visual_tokens"]) == 16  # keep 0.5 of 16 tokens
    text = (tmp_path / "table.md").read_text()
    assert "**DRY RUN**" in text and "## Sources" in text and "arXiv:2502.11494 Table 1" in text
    stored = json.loads((tmp_path / "runs" / "llava-1.5-7b" / "fastv-0.5" / "dry_run_results.json").read_text())
    assert stored["throughput"]["avg_vtprune_kept_fraction"] == 0.5 and "vtprune_shapes" in stored["results"]
