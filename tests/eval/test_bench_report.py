"""The benchmark report's goal lines, computed by hand from a few CSV rows."""

from __future__ import annotations

from vtprune.eval.accuracy.report import answered_types, goal_summary, markdown_table, pooled


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


def test_goal_lines_by_hand() -> None:
    lines = goal_summary(_rows())
    assert "keep 0.25: accuracy 0.730 (fastv) = 97.3 % of unpruned 0.750; target 97 %: reached" in lines[2]
    assert "keep 0.11: accuracy 0.690 (fastv) = 92.0 % of unpruned 0.750; target 93 %: below target" in lines[3]
    assert "evidence recall 0.700 (fastv), all questions; target 0.8: below target" in lines[4]  # random excluded
    assert "evidence recall 0.900 (fastv) on the types the unpruned model answers (color)" in lines[5]
    assert "Evidence recall per question type" in markdown_table(_rows())


def test_no_goal_lines_without_an_unpruned_reference() -> None:
    rows = [{**r, "accuracy": "0.0"} if r["method"] == "none" else r for r in _rows()]
    assert goal_summary(rows) == []  # a random-weight model: nothing to take a percentage of


def test_a_ratio_just_below_its_target_never_reads_as_the_target() -> None:
    rows = [{**r, "accuracy": "0.832"} if r["method"] == "none" and r["qtype"] == "all" else r for r in _rows()]
    rows = [{**r, "accuracy": "0.807"} if (r["method"], r["keep"], r["qtype"]) == ("fastv", "0.25", "all") else r
            for r in rows]
    line = goal_summary(rows)[2]
    assert "= 96.9 % of unpruned 0.832; target 97 %: below target" in line  # 0.807 / 0.832 = 0.96995


def test_the_report_explains_its_columns() -> None:
    text = markdown_table(_rows())
    assert text.startswith("| method |") and "Columns: *accuracy*" in text and "bench --speed" in text
