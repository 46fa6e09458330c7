"""``vtprune bench reproduce``: the papers' numbers, the lmms-eval runs that reproduce them, the table.

The dry run (embedded models, local ``vtprune_shapes`` task, CPU) goes through the whole pipeline in one to
two minutes; the GPU commands are checked against lmms-eval's own parser and task index (with the written task
variants), and each protocol switch against an independent computation: the TextVQA prompt against LLaVA's
three-line OCR prompt, pad-to-square against a canvas built by hand and transformers' ``LlavaImageProcessor``,
POPE's F1 against counts done by hand, PyramidDrop's average budget against the tokens a wrapped 32-layer model
keeps.
"""

from __future__ import annotations

import csv
import gc
import json
import shlex
import sys
from pathlib import Path

import pytest
from vtprune.eval.papers import reproduce
from vtprune.eval.papers.data import MODELS, benchmark_task
from vtprune.eval.papers.reproduce import RELATIVE, PaperRow, Setting, load_papers
from vtprune.eval.papers.table import measured

PAPERS_REPRODUCED = {"fastv", "pdrop", "visionzip", "divprune", "dart", "transprune"}
LLAVA = "llava-1.5-7b"


def test_data_file_cites_a_source_for_every_number() -> None:
    rows = load_papers()
    assert PAPERS_REPRODUCED <= {r.method for r in rows if r.value is not None and r.keep is not None}
    for row in rows:
        assert "arXiv:" in row.source or "Table" in row.source or "README" in row.source, row
        assert row.value is not None or row.note, f"an empty number needs a note saying why: {row}"
        assert row.keep is not None or row.note, f"a row that cannot run needs a note saying why: {row}"
    assert {r.model for r in rows} == {LLAVA, "llava-next-7b", "qwen2.5-vl-7b"}
    assert {"MME-C", "MMMU"} <= {r.benchmark for r in rows}
    fastv = {r.benchmark: r.value for r in rows if r.options == "layer=3" and r.keep == 0.5}
    assert fastv == {"GQA": 60.4, "MMMU": 35.2, "MME-C": 349.3, "MME-P": 1511.7}  # FastV's README, K=3 R=50 %
    own = {r.benchmark: r.value for r in rows if r.method == "pdrop" and r.keep == 0.125 and not r.options}
    assert own == {"MME-P": 1500.8, "SQA-IMG": 69.2, "GQA": 60.1, "POPE": 84.8, "TextVQA": 57.5}
    assert all("unconfirmed" in r.note for r in rows if r.value is None and r.keep is not None)
    assert not any("the table does not say" in r.note or "same rows in DART" in r.source for r in rows)


def test_a_typo_in_the_data_file_names_its_line(tmp_path: Path) -> None:
    head = "paper,model,method,keep,tokens,benchmark,value,options,source,note\n"
    (tmp_path / "bad.csv").write_text(head + "FastV,llava-1.5-7b,fastv,0.5,288,GQA,60.4,layr=3,README,\n")
    with pytest.raises(ValueError, match="bad.csv:2: options 'layr=3'"):
        load_papers(tmp_path / "bad.csv")


def test_plan_runs_each_setting_once_plus_the_unpruned_reference() -> None:
    runs = reproduce.plan(load_papers())
    llava = {s: t for s, t in runs.items() if s.model == LLAVA}
    assert Setting(LLAVA, "none", 1.0) in llava and Setting(LLAVA, "dart", 0.111111) in llava
    assert set(llava[Setting(LLAVA, "none", 1.0)]) == set().union(*llava.values())
    rel5 = sorted({benchmark_task(b, "qwen2.5-vl-7b") for b in RELATIVE["REL5"]})
    assert runs[Setting("qwen2.5-vl-7b", "visionzip", 0.2)] == rel5
    assert not any(s.method == "transprune" for s in runs if s.model == "qwen2.5-vl-7b")  # keep not released
    assert Setting(LLAVA, "fastv", 0.5, "layer=3") in runs and Setting(LLAVA, "fastv", 0.5) in runs  # two protocols
    assert {s.method for s in runs if s.model == "llava-next-7b"} == {"none", "visionzip", "dart", "transprune"}


def test_each_run_follows_the_papers_protocol() -> None:
    """LLaVA-1.5 rows: TextVQA with OCR tokens, POPE scored both ways, pad to square (LLaVA-1.5 only); FastV's layer;
    VisionZip's exact map; MMBench judge or static as asked. LLaVA-NeXT: each row's own TextVQA prompt."""
    runs = reproduce.plan(load_papers(), mmbench="static")
    for setting, tasks in runs.items():
        args = reproduce.model_args(setting, False, 8)
        assert ("image_aspect_ratio=pad" in args) == (setting.model == LLAVA), args
        assert ("queries=all" in args) == (setting.method == "visionzip")
        assert "mmbench_en_dev" not in tasks  # static scoring asked: mmbench_en_dev_static
        if setting.model == LLAVA:
            assert "textvqa_val" not in tasks and ("vtprune_textvqa_val_ocr" in tasks or "mmmu_val" in tasks)
    assert "layer=3" in reproduce.model_args(Setting(LLAVA, "fastv", 0.5, "layer=3"), False, 8)
    assert "textvqa_val" in runs[Setting("qwen2.5-vl-7b", "none", 1.0)]  # its papers' protocol is not LLaVA's
    assert "mmbench_en_dev" in reproduce.plan(load_papers(), mmbench="judge")[Setting(LLAVA, "none", 1.0)]


def test_metrics_are_on_the_papers_scale_and_relative_scores_use_the_same_model() -> None:
    file = {"results": {"mme": {"mme_perception_score,none": 1500.0, "mme_cognition_score,none": 350.0},
                        "vtprune_pope": {"pope_f1_llava,none": 0.86, "pope_f1_score,none": 0.85},
                        "gqa": {"exact_match,none": 0.6}, "mmmu_val": {"mmmu_acc,none": 0.352},
                        "mmbench_en_dev": {"gpt_eval_score,none": 64.0},
                        "vtprune_textvqa_val_ocr": {"exact_match,none": 0.5}}}
    assert reproduce.metric(file, "MME", False) == 1850.0 and reproduce.metric(file, "MME-P", False) == 1500.0
    assert reproduce.metric(file, "MME-C", False) == 350.0 and reproduce.metric(file, "MMMU", False) == pytest.approx(35.2)
    assert reproduce.metric(file, "POPE", False) == pytest.approx(86.0)  # the papers' F1
    assert reproduce.metric(file, "POPE", False, lmms_way=True) == pytest.approx(85.0)  # lmms-eval's, beside it
    assert reproduce.metric(file, "GQA", False, lmms_way=True) is None  # scored the same way: no second number
    assert reproduce.metric(file, "SQA-IMG", False) is None  # task not in the file: no number, not a zero
    half = {"results": {task: {k: v / 2 for k, v in values.items()} for task, values in file["results"].items()}}
    runs = {Setting(LLAVA, "none", 1.0): {"results": file}, Setting(LLAVA, "x", 0.2): {"results": half}}
    row = PaperRow("p", LLAVA, "x", 0.2, "", "REL5", 90.0, "s", "")
    assert measured(row, runs, False) == pytest.approx(50.0)


def test_unknown_methods_are_refused_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        reproduce.main(["--print-commands", "--methods", "bogus,fastv"])
    message = str(stop.value.code)
    assert "\n" not in message and "--methods bogus" in message
    assert ("cdpruner, dart, divprune, fastv, hiprune, idpruner, mmtok, pdrop, scope, sparsevlm, transprune, visionzip, "
            "vispruner, vscan") in message
    with pytest.raises(SystemExit, match="unknown --models nosuch; choose from llava-1.5-7b"):
        reproduce.main(["--print-commands", "--models", "nosuch"])


def test_a_local_checkpoint_replaces_the_hub_id(tmp_path: Path, capsys) -> None:
    (tmp_path / "llava").mkdir()
    (tmp_path / "llava" / "config.json").write_text("{}")
    assert reproduce.main(["--print-commands", "--models", LLAVA, "--methods", "dart", "--out", str(tmp_path),
                           "--checkpoint", f"llava-1.5-7b={tmp_path / 'llava'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(f"pretrained={tmp_path / 'llava'}," in line for line in lines)
    with pytest.raises(SystemExit):
        reproduce.main(["--print-commands", "--out", str(tmp_path), "--checkpoint", f"llava-1.5-7b={tmp_path}"])
    assert "holds no config.json" in capsys.readouterr().err


def test_a_run_without_results_file_is_an_error(tmp_path: Path) -> None:
    """lmms-eval logs its errors and exits 0, so the missing results file must stop the script."""
    with pytest.raises(RuntimeError, match="wrote no results"):
        reproduce.run_subprocess(["--model", "x"], tmp_path / "run", [sys.executable, "-c", "pass"])


def test_gpu_commands_parse_with_lmms_eval_and_name_its_tasks(tmp_path: Path, capsys) -> None:
    from lmms_eval.__main__ import parse_eval_args
    from lmms_eval.tasks import TaskManager

    assert reproduce.main(["--print-commands", "--launcher", "accelerate launch --num_processes 8",
                           "--out", str(tmp_path)]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert len(commands) == len(reproduce.plan(load_papers()))
    known = set(TaskManager(include_path=str(tmp_path / "tasks")).all_tasks)
    assert {"vtprune_textvqa_val_ocr", "vtprune_pope", "mmbench_en_dev_static"} <= known
    for words in commands:
        assert words[:4] == ["accelerate", "launch", "--num_processes", "8"] and words[4:6] == ["-m", "lmms_eval"]
        argv, sys.argv = sys.argv, ["lmms_eval", *words[6:]]
        try:
            _, args = parse_eval_args()
        finally:
            sys.argv = argv
        assert set(args.tasks.split(",")) <= known, args.tasks
        assert args.include_path == str(tmp_path / "tasks")
        assert "pretrained=llava-hf/" in args.model_args or "pretrained=Qwen/" in args.model_args


@pytest.mark.slow
def test_dry_run_writes_the_table_with_the_papers_columns(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # lmms-eval's model.clean() runs gc.collect() twice per run: over the whole test process's heap that costs
    # more than the run; frozen, the collections scan only what the runs create (and free it as before).
    gc.freeze()
    try:
        assert reproduce.main(["--dry-run", "--limit", "4", "--batch-size", "8", "--out", str(tmp_path)]) == 0
    finally:
        gc.unfreeze()
    lines = list(csv.DictReader(open(tmp_path / "table.csv")))
    rows = load_papers()
    assert len(lines) == len(rows)
    import vtprune

    registered = set(vtprune.list_methods())
    for line, row in zip(lines, rows, strict=True):
        assert line["paper_value"] == ("" if row.value is None else str(row.value))
        if row.keep is None or row.method not in registered:  # not run: no measured side, said so
            assert line["measured"] == "" and line["wall_s"] == ""
            assert row.keep is None or "not run" in line["note"]
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


# ---------------------------------------------------------------------------------------------------------
# the protocol switches, each against an independent computation
# ---------------------------------------------------------------------------------------------------------
def test_textvqa_variant_prompts_with_the_reference_ocr_tokens(tmp_path: Path) -> None:
    """The written task is lmms-eval's textvqa_val with LLaVA's three-line prompt: question, OCR tokens, instruction
    (LLaVA's eval_textvqa.py reads the question back as the first of exactly three lines)."""
    from lmms_eval.utils import load_yaml_config
    from vtprune.eval.lmms_plugin.paper_tasks import lmms_task_file, write_paper_tasks

    folder = write_paper_tasks(tmp_path)
    ours = load_yaml_config(str(folder / "vtprune_textvqa_val_ocr.yaml"))
    stock = load_yaml_config(str(lmms_task_file("textvqa", "textvqa_val.yaml")))
    doc = {"question": "what brand is the camera?", "ocr_tokens": ["nikon", "d40"], "answers": ["nikon"] * 10}
    prompt = ours["doc_to_text"](doc, ours["lmms_eval_specific_kwargs"]["default"])
    lines = prompt.split("\n")
    assert len(lines) == 3 and lines[1] == "Reference OCR token: nikon, d40"
    assert lines[0].lower() == doc["question"] and lines[2] == "Answer the question using a single word or phrase."
    assert "Reference OCR token" not in stock["doc_to_text"](doc, stock["lmms_eval_specific_kwargs"]["default"])
    assert ours["dataset_path"] == stock["dataset_path"] and ours["process_results"] is not None  # only the prompt
    bare = ours["doc_to_text"]({**doc, "ocr_tokens": []}, ours["lmms_eval_specific_kwargs"]["default"])
    assert bare.split("\n") == [lines[0], lines[2]]  # no OCR tokens: LLaVA's two lines, no empty OCR line


def test_pope_f1_is_the_mean_of_the_per_split_f1_with_llavas_answer_mapping(tmp_path: Path) -> None:
    from lmms_eval.utils import load_yaml_config
    from vtprune.eval.lmms_plugin.paper_tasks import write_paper_tasks

    config = load_yaml_config(str(write_paper_tasks(tmp_path) / "vtprune_pope.yaml"))
    process = config["process_results"]
    aggregate = {m["metric"]: m["aggregation"] for m in config["metric_list"]}
    answers = {  # (split, label, answer): random: TP 2, FN 1 ("not"), FP 1; adversarial: TP 1, TN 1 ("No,")
        ("random", "yes", "Yes"), ("random", "yes", "Yes, there is."), ("random", "yes", "There is not."),
        ("random", "no", "Yes"), ("adversarial", "yes", "yes"), ("adversarial", "no", "No, there is none."),
    }
    records = [process({"question_id": i, "answer": label, "category": split}, [answer])
               for i, (split, label, answer) in enumerate(sorted(answers))]
    by_hand = (2 * (2 / 3) * (2 / 3) / (4 / 3) + 1.0) / 2  # random: P 2/3, R 2/3; adversarial: F1 1
    assert aggregate["pope_f1_llava"]([r["pope_f1_llava"] for r in records]) == pytest.approx(by_hand)
    pooled = aggregate["pope_f1_score"]([r["pope_f1_score"] for r in records])  # lmms-eval: exact "yes" / "no"
    assert pooled == pytest.approx(2 * (2 / 3) * 1.0 / (2 / 3 + 1.0))  # TP 2, FP 1; sentences count nowhere
    from vtprune.eval.lmms_plugin.paper_tasks import llava_yes_no

    # eval_pope.py's words are exact and case-sensitive: "Not" is none of No / no / not (the docstring's examples)
    assert [llava_yes_no(a) for a in ("Not really.", "There is not.", "Nope", "no.")] == ["yes", "no", "yes", "no"]


def test_pad_to_square_reaches_the_model_through_the_processor(tmp_path: Path) -> None:
    """A real non-square image: the plugin's pixels equal the processor's pixels of a canvas built by hand (the
    image centred on its longer side, filled with int(255 * mean)) and transformers' LlavaImageProcessor(do_pad)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import LlavaImageProcessor
    from vtprune.eval.lmms_plugin.models import VTPruneLlava

    image = Image.open(Path(__file__).resolve().parents[2] / "docs" / "demo.png").convert("RGB").crop((0, 0, 700, 420))
    lm = VTPruneLlava(pretrained="embedded:llava", method="none", keep=1.0, device="cpu", image_aspect_ratio="pad")
    pixels = lm._inputs(["What is it?"], [[image]])["pixel_values"]
    processor = lm.processor.image_processor
    canvas = np.zeros((700, 700, 3), dtype=np.uint8)
    canvas[:] = [int(255 * m) for m in processor.image_mean]
    canvas[140:560] = np.asarray(image)  # (700 - 420) // 2 = 140 rows above
    by_hand = processor(images=[Image.fromarray(canvas)], return_tensors="pt")["pixel_values"]
    assert torch.allclose(pixels, by_hand)
    config = {k: getattr(processor, k) for k in ("size", "crop_size", "image_mean", "image_std", "resample")}
    reference = LlavaImageProcessor(**config, do_pad=True)(images=[image], return_tensors="pt")["pixel_values"]
    assert torch.allclose(pixels, reference, atol=1e-5)
    plain = VTPruneLlava(pretrained="embedded:llava", method="none", keep=1.0, device="cpu")
    assert not torch.allclose(plain._inputs(["What is it?"], [[image]])["pixel_values"], pixels)  # the switch acts
    lm.handle.remove()
    plain.handle.remove()


def _wrapped_32_layer_llava() -> tuple:
    """A random-weight LLaVA with LLaVA-1.5-7B's geometry where it matters here: 32 decoder layers, 576 visual
    tokens (a 336 px image of 14 px patches)."""
    import torch

    from vtprune.models import tiny

    config, model_cls, processor = tiny._llava("llava", 336)
    config.text_config.num_hidden_layers = 32
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation="eager").eval(), processor


def test_pdrop_average_budget_runs_at_the_rows_tokens_per_layer() -> None:
    """Each ``budget=average`` PyramidDrop row's model arguments, wrapped on a 32-layer model with 576 visual
    tokens: the visual tokens each layer sees, averaged over the layers, equal the row's token count within one
    token per layer (counted from what the prefill kept, not from the schedule)."""
    import torch
    from lmms_eval.utils import simple_parse_args_string
    from vtprune.eval.lmms_plugin.args import parse_model_args

    import vtprune
    from vtprune.config import Stage
    from vtprune.methods.schedules import pyramid
    from vtprune.models.tiny import random_image, tiny_inputs

    model, processor = _wrapped_32_layer_llava()
    inputs = tiny_inputs(processor, "llava", [("What is it?", [random_image(336, 336, 0)])])
    rows = [r for r in load_papers() if r.options == "budget=average"]
    assert {int(r.tokens) for r in rows} == {192, 128, 64}
    for tokens in sorted({int(r.tokens) for r in rows}):
        row = next(r for r in rows if int(r.tokens) == tokens)
        args = simple_parse_args_string(reproduce.model_args(reproduce.row_setting(row), False, 1))
        prune = parse_model_args({k: v for k, v in args.items() if k not in ("pretrained", "dtype")}).prune
        handle = vtprune.wrap(model, prune)
        with torch.inference_mode():
            model(**inputs)
        stats = handle.last_stats
        handle.remove()
        assert stats.visual_tokens == [576] and len(stats.stage_layers) == 3
        seen = [576 if layer < stats.stage_layers[0] else
                stats.kept[max(i for i, start in enumerate(stats.stage_layers) if start <= layer)][0]
                for layer in range(32)]
        assert abs(sum(seen) / 32 - tokens) <= 1.0, (tokens, stats.stage_layers, stats.kept)
        assert 0.4 < prune.stages[0].keep < 0.6  # PyramidDrop's ratio between stages, near its 0.5
    own = next(r for r in load_papers() if r.method == "pdrop" and not r.options)  # the paper's own row
    assert "schedule" not in reproduce.model_args(reproduce.row_setting(own), False, 1)
    assert pyramid(32, own.keep) == (Stage(8, 0.5), Stage(16, 0.25), Stage(24, 0.125))  # layers 8/16/24, ratio 0.5


def test_visionzip_uses_the_exact_map_on_a_gpu_and_in_reproduce() -> None:
    from vtprune.methods import tower

    big = tower.FAST_PATCHES + 1
    assert tower.tower_rows("auto", big, "cuda:0") is None  # exact on an accelerator
    assert tower.tower_rows("auto", big, "cpu") == tower.tower_rows("auto", big) == tower.FAST_ROWS  # CPU shortcut
    assert tower.tower_rows("all", big, "cpu") is None
    setting = next(s for s in reproduce.plan(load_papers()) if s.method == "visionzip" and s.model == "qwen2.5-vl-7b")
    assert "queries=all" in reproduce.model_args(setting, False, 1)
    assert MODELS["qwen2.5-vl-7b"].args.endswith("max_pixels=1605632")  # above 6,144 patches: auto would sample
