"""The benchmark report's closing lines (the best criterion at each keep against fixed levels), computed by hand
from a few CSV rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from vtprune.eval.accuracy.report import answered_types, best_criteria, markdown_table, pooled

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _row(method: str, keep: float, qtype: str, n: int, acc: float, recall: float) -> dict:
    return {"model": "m", "method": method, "keep": str(keep), "qtype": qtype, "n": str(n), "accuracy": str(acc),
            "evidence_recall": str(recall), "mean_kept": "4", "flops_ratio": "0.5", "prefill_ms_p50": "1.0",
            "device": "cpu", "threads": "2", "dtype": "fp32", "attn_implementation": "sdpa", "batch_size": "1",
            "torch": "t", "transformers": "x", "vtprune": "v", "git_sha": "s", "date": "d"}


def _rows() -> list[dict]:
    # Unpruned: colour 1.0 (30 questions), read 0.0 (10 questions) -> overall 0.75.
    rows = [_row("none", 1, "color", 30, 1.0, 1.0), _row("none", 1, "read", 10, 0.0, 1.0),
            _row("none", 1, "all", 40, 0.75, 1.0)]
    # fastv at keep 0.25: colour recall 0.9, read recall 0.1 -> all 0.7; accuracy 0.73 (97.3 %).
    rows += [_row("fastv", 0.25, "color", 30, 0.9733, 0.9), _row("fastv", 0.25, "read", 10, 0.0, 0.1),
             _row("fastv", 0.25, "all", 40, 0.73, 0.7)]
    rows += [_row("random", 0.25, "all", 40, 0.74, 0.25), _row("fastv", 0.11, "all", 40, 0.69, 0.5)]
    return rows


def test_answered_types_and_pooled_recall() -> None:
    rows = _rows()
    assert answered_types(rows) == ["color"]
    assert abs(pooled(rows, "fastv", 0.25, ["color", "read"], "evidence_recall") - 0.7) < 1e-9  # (27 + 1) / 40


def test_best_criterion_lines_by_hand() -> None:
    lines = best_criteria(_rows())
    assert "97 / 93 / 90 % at keep 0.25 / 0.11 / 0.1" in lines[0] and "0.8 at keep 0.25" in lines[0]
    assert lines[2] == "- keep 0.25: accuracy 0.730 (fastv) = 97.3 % of unpruned 0.750 (>= 97 %)"
    assert lines[3] == "- keep 0.11: accuracy 0.690 (fastv) = 92.0 % of unpruned 0.750 (< 93 %)"
    assert lines[4] == "- keep 0.25: evidence recall 0.700 (fastv), all questions (< 0.8)"  # random excluded
    assert "evidence recall 0.900 (fastv) on the types the unpruned model answers (color)" in lines[5]
    assert "Evidence recall per question type" in markdown_table(_rows())


def test_no_comparison_without_an_unpruned_reference() -> None:
    rows = [{**r, "accuracy": "0.0"} if r["method"] == "none" else r for r in _rows()]
    assert best_criteria(rows) == []  # a random-weight model: nothing to take a percentage of


def test_a_ratio_just_below_its_level_never_reads_as_the_level() -> None:
    rows = [{**r, "accuracy": "0.832"} if r["method"] == "none" and r["qtype"] == "all" else r for r in _rows()]
    rows = [{**r, "accuracy": "0.807"} if (r["method"], r["keep"], r["qtype"]) == ("fastv", "0.25", "all") else r
            for r in rows]
    line = best_criteria(rows)[2]
    assert line.endswith("= 96.9 % of unpruned 0.832 (< 97 %)")  # 0.807 / 0.832 = 0.96995


def test_the_report_explains_its_columns() -> None:
    text = markdown_table(_rows())
    assert text.startswith("| method |") and "Columns: *accuracy*" in text and "bench --speed" in text


def _long_row(method: str, keep: float, acc: float, recall: float) -> dict:
    return {"group": "8 images", "method": method, "keep": str(keep), "qtype": "all", "accuracy": str(acc),
            "evidence_recall": str(recall)}


def test_long_report_best_token_method_lines_by_hand() -> None:
    from vtprune.eval.accuracy.long_report import best_criteria

    rows = [_long_row("none", 1.0, 0.8, 1.0), _long_row("random", 0.25, 0.9, 0.3),  # random: a reference line
            _long_row("fastv", 0.25, 0.78, 0.85), _long_row("pdrop", 0.25, 0.7, 0.9), _long_row("fastv", 0.1, 0.7, 0.5)]
    assert best_criteria(rows, "8 images") == [
        "- 8 images, keep 0.25: best fastv 0.780 = 97.5 % of unpruned 0.800 (>= 97 %)",
        "- 8 images, keep 0.1: best fastv 0.700 = 87.5 % of unpruned 0.800 (< 90 %)",
        "- 8 images, keep 0.25: best evidence recall 0.900 (pdrop) (>= 0.8)"]


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in (RESULTS.glob("*/bench.csv"))) +
                         sorted(p.parent.name for p in RESULTS.glob("*/long.csv")))
def test_committed_reports_are_what_the_report_writes_from_their_csv(folder) -> None:
    """Each committed bench.md / long.md equals what the current code writes from the CSV beside it."""
    from vtprune.eval.accuracy import long_report
    from vtprune.eval.accuracy.report import read_rows

    if (RESULTS / folder / "bench.csv").is_file():
        assert (RESULTS / folder / "bench.md").read_text() == markdown_table(read_rows(RESULTS / folder / "bench.csv"))
    else:
        rows = read_rows(RESULTS / folder / "long.csv")
        assert (RESULTS / folder / "long.md").read_text() == long_report.markdown(rows, rows[0])
