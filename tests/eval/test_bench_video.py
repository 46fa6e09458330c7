"""``vtprune bench --video``: all frames vs uniform M_eff vs GridProbe x token methods, end to end on a tiny model."""

from __future__ import annotations

import csv

import pytest
import torch
from vtprune.eval.accuracy.video import answer_letter, choose_k, load_questions, method_spec, question_options

from vtprune.cli import main

torch.set_num_threads(1)

OPTIONS = {"A": "square", "B": "triangle", "C": "cross", "D": "circle"}


def test_options_are_parsed_from_the_question_text():
    question = load_questions("test", 1)[0]
    assert list(question_options(question.text)) == ["A", "B", "C", "D"]
    assert question.answer in question.options and len(question.evidence) >= 2
    text = "What shape is it? A. square B. triangle C. cross D. circle Answer with the letter."
    assert question_options(text) == OPTIONS


@pytest.mark.parametrize(("text", "expected"), [
    ("B", ("B", False)), ("B.", ("B", False)), ("(C) cross", ("C", False)), (" D ", ("D", False)),
    ("cross", ("C", True)), ("Circle.", ("D", True)), ("the cross", ("C", True)),
    ("red", (None, False)), ("square or circle", (None, False)), ("", (None, False)),
])
def test_answers_are_letters_or_option_text_mapped_to_its_letter(text, expected):
    assert answer_letter(text, OPTIONS) == expected


def test_prompts_longer_than_the_context_are_a_clear_error():
    from vtprune.models.tiny import tiny_model

    model, processor = tiny_model("qwen2_vl")
    question = load_questions("test", 1)[0]
    assert choose_k(model, processor, question, "images", 4, 4) == 4
    model.config.text_config.max_position_embeddings = 300  # ~18 tokens per frame: 9 frames fit, 16 do not
    with pytest.raises(ValueError, match=r"max_position_embeddings is 300: .* at most 1\d frames fit.*smaller --k"):
        choose_k(model, processor, question, "images", 4, 4)
    assert choose_k(model, processor, question, "images", None, 4) == 3


def test_bench_video_writes_a_well_formed_csv_table_and_plot(tmp_path, capsys):
    code = main(["bench", "--video", "--model", "tiny:qwen2_vl", "--device", "cpu", "--clips", "2", "--k", "3",
                 "--methods", "none,fastv", "--keep", "1,0.5", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    with (tmp_path / "bench_video.csv").open() as f:
        rows = list(csv.DictReader(f))
    by_key = {(r["selection"], r["method"], float(r["keep"])): r for r in rows}
    assert set(by_key) == {(s, m, k) for s in ("all", "uniform", "gridprobe")
                           for m, k in (("none", 1.0), ("fastv", 1.0), ("fastv", 0.5))}
    required = {"model", "n", "accuracy", "answers_mapped", "evidence_recall", "evidence_hit", "mean_frames",
                "probe_gflops", "answer_gflops", "lm_gflops", "flops_ratio", "time_ms_p50", "k", "device",
                "threads", "dtype", "attn_implementation", "torch", "transformers", "git_sha"}
    assert required <= set(rows[0]) and all(r["n"] == "4" and r["k"] == "3" for r in rows)
    assert float(by_key[("all", "none", 1.0)]["flops_ratio"]) == 1.0
    assert float(by_key[("all", "fastv", 0.5)]["flops_ratio"]) < 1.0
    assert all(float(r["flops_ratio"]) > 0 and float(r["time_ms_p50"]) > 0 for r in rows)
    assert all(0 <= float(r[c]) <= 1 for r in rows for c in ("accuracy", "evidence_recall", "evidence_hit"))
    probe = by_key[("gridprobe", "none", 1.0)]
    assert float(probe["probe_gflops"]) > 0 and float(by_key[("uniform", "none", 1.0)]["probe_gflops"]) == 0
    assert float(by_key[("all", "none", 1.0)]["mean_frames"]) == 9.0
    assert probe["mean_frames"] == by_key[("uniform", "none", 1.0)]["mean_frames"] == probe["mean_m_eff"]
    assert (tmp_path / "bench_video.md").read_text().startswith("| selection | method |")
    assert (tmp_path / "video_accuracy_vs_flops.png").stat().st_size > 1000


def test_bench_video_runs_temporal_and_per_frame_variants(tmp_path, capsys):
    assert method_spec("fastv") == ("fastv", "global", {})
    assert method_spec("pdrop@per_frame") == ("pdrop", "per_frame", {})
    assert method_spec("temporal@fastv") == ("temporal", "global", {"then": "fastv"})
    with pytest.raises(ValueError, match="temporal@NAME"):
        method_spec("fastv@pdrop")
    code = main(["bench", "--video", "--model", "tiny:qwen2_vl", "--device", "cpu", "--clips", "1", "--k", "2",
                 "--methods", "temporal,fastv@per_frame,temporal@fastv", "--keep", "0.5", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    with (tmp_path / "bench_video.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == {"temporal", "fastv@per_frame", "temporal@fastv"}
    assert all(float(r["flops_ratio"]) < 1.0 for r in rows if r["selection"] != "gridprobe")
