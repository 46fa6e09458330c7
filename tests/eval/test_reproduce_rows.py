"""``vtprune bench reproduce``: each paper row compared with its own protocol, and the leaders' rows.

Per-row scoring (TextVQA with or without the OCR tokens, POPE per split or pooled), TransPrune's LLaVA-NeXT
reference, the PyramidDrop average budgets that cannot test ``pdrop``, the PIL image processor of the LLaVA rows,
and the published rows of SparseVLM, VisPruner, CDPruner, VScan, MMTok, HiPrune, SCOPE and IDPruner (planned
once registered).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vtprune.eval.papers import reproduce
from vtprune.eval.papers.data import parse_options
from vtprune.eval.papers.protocols import protocol_note
from vtprune.eval.papers.reproduce import Setting, load_papers
from vtprune.eval.papers.table import measured

LLAVA = "llava-1.5-7b"
LEADERS = {"sparsevlm", "vispruner", "cdpruner", "vscan", "mmtok", "hiprune", "scope",
           "idpruner"}  # their rows: planned once registered


def test_llava_next_textvqa_rows_compare_with_their_own_prompt() -> None:
    """LLaVA-NeXT's 64.9 (DART's reference) is the score without OCR tokens, TransPrune's 61.3 the one with them
    (haotian-liu/LLaVA#1326: 61.35 with the OCR file): each row reads its own task of the same unpruned run."""
    rows = [r for r in load_papers() if r.model == "llava-next-7b" and r.benchmark == "TextVQA" and r.value]
    by_source = {("TransPrune" in r.source, r.method): r for r in rows}
    dart_full, transprune_full = by_source[(False, "none")], by_source[(True, "none")]
    assert (dart_full.value, transprune_full.value) == (64.9, 61.3)
    runs = reproduce.plan(load_papers())
    full = Setting("llava-next-7b", "none", 1.0)
    assert {"textvqa_val", "vtprune_textvqa_val_ocr"} <= set(runs[full])
    assert "vtprune_textvqa_val_ocr" not in runs[Setting("llava-next-7b", "dart", 0.111111)]
    assert "textvqa_val" not in runs[Setting("llava-next-7b", "transprune", 0.125)]
    file = {"results": {"textvqa_val": {"exact_match,none": 0.64}, "vtprune_textvqa_val_ocr": {"exact_match,none": 0.61}}}
    done = {full: {"results": file}}
    assert measured(dart_full, done, False) == pytest.approx(64.0)  # no OCR tokens, as 64.9
    assert measured(transprune_full, done, False) == pytest.approx(61.0)  # OCR tokens, as 61.3
    assert "with the reference OCR tokens" in protocol_note(transprune_full, "judge")
    assert "without OCR tokens" in protocol_note(dart_full, "judge")


def test_transprune_llava_next_rows_have_their_own_unpruned_row() -> None:
    """TransPrune's Table 2 upper bound sits beside its LLaVA-NeXT rows (one per benchmark it reports)."""
    rows = load_papers()
    own = {r.benchmark: r.value for r in rows if r.model == "llava-next-7b" and r.method == "none"
           and r.source.startswith("TransPrune")}
    assert own == {"GQA": 64.3, "MMB": 67.9, "MME-P": 1520, "POPE": 86.5, "SQA-IMG": 70.2, "TextVQA": 61.3}
    pruned = {r.benchmark for r in rows if r.model == "llava-next-7b" and r.method == "transprune"}
    assert pruned == set(own)


def test_early_average_pdrop_schedules_are_labelled_unable_to_test_pdrop() -> None:
    """At 128 and 64 tokens the average budget forces a first drop at layer 2 and 1 of 32 (PyramidDrop's own first
    drop is at layer 8): those rows say they cannot test vtprune's pdrop; the 192-token row (layer 5) does not."""
    rows = [r for r in load_papers() if r.options == "budget=average" and r.benchmark == "GQA"]
    labelled = {r.tokens: "cannot test vtprune's pdrop" in protocol_note(r, "judge") for r in rows}
    assert labelled == {"192": False, "128": True, "64": True}
    own = next(r for r in load_papers() if r.method == "pdrop" and not r.options and r.benchmark == "SQA-IMG")
    assert "66.8" in own.note  # PyramidDrop's Table 5 baseline SQA-IMG


def test_pope_rows_say_which_scoring_is_like_for_like() -> None:
    """Rows from lmms-eval runs (MMTok's, its DivPrune re-run) are marked pooled; LLaVA-script rows per split."""
    pope = [r for r in load_papers() if r.benchmark == "POPE" and r.keep is not None]
    for row in pope:
        pooled = row.source.startswith("MMTok")  # MMTok's own lmms-eval runs, not what it transcribed
        assert ("pope=pooled" in row.options) == pooled, row
        note = protocol_note(row, "judge")
        assert ("like-for-like number is the lmms-eval's way column" in note) == pooled, note
        if row.model == LLAVA and not pooled:
            assert "measured is like for like" in note
    with pytest.raises(ValueError, match="pope=per-split"):
        parse_options("pope=sum")


def test_qwen_resolution_note_only_where_the_paper_does_not_state_it() -> None:
    rows = [r for r in load_papers() if r.model == "qwen2.5-vl-7b" and r.keep is not None]
    for row in rows:
        assert ("resolution bounds" in protocol_note(row, "judge")) == ("MMTok" not in row.source), row


def test_llava_rows_load_the_pil_image_processor_as_the_original_code_resized(tmp_path: Path) -> None:
    """transformers 5 picks the torchvision image processor where torchvision is installed (a GPU install); the
    LLaVA rows ask for ``image_backend=pil``, whose resize is PIL's, as the original LLaVA code ran. A processor
    of the torchvision class name is turned into its PIL twin with the same settings and the same pixels."""
    import torch
    from PIL import Image
    from vtprune.eval.lmms_plugin.args import parse_model_args
    from vtprune.eval.lmms_plugin.inputs import pil_image_processor
    from vtprune.eval.lmms_plugin.models import VTPruneLlava

    for setting in reproduce.plan(load_papers()):
        assert ("image_backend=pil" in reproduce.model_args(setting, False, 8)) == setting.model.startswith("llava")
    lm = VTPruneLlava(pretrained="embedded:llava", method="none", keep=1.0, device="cpu", image_backend="pil")
    pil = lm.processor.image_processor
    assert type(pil).__name__ == "CLIPImageProcessorPil"
    settings = pil.to_dict()

    class CLIPImageProcessor:  # the torchvision class's name and settings (torchvision is not installed here)
        def to_dict(self) -> dict:
            return dict(settings)

    twin = pil_image_processor(CLIPImageProcessor())
    assert type(twin).__name__ == "CLIPImageProcessorPil" and twin.size == pil.size and twin.resample == pil.resample
    image = Image.open(Path(__file__).resolve().parents[2] / "docs" / "demo.png").convert("RGB").crop((0, 0, 700, 420))
    assert torch.equal(twin(images=[image], return_tensors="pt")["pixel_values"],
                       pil(images=[image], return_tensors="pt")["pixel_values"])
    assert pil_image_processor(pil) is pil
    lm.handle.remove()
    with pytest.raises(ValueError, match="image_backend='fast': use default"):
        parse_model_args({"pretrained": "embedded:llava", "image_backend": "fast"})


def test_the_leaders_rows_cite_their_tables_and_say_how_they_were_read() -> None:
    """Every leader has rows at LLaVA-1.5-7B's budgets; a number copied from elsewhere says second-hand, one not
    read says unconfirmed and has no value; the values checked by hand against the text conversions match."""
    rows = [r for r in load_papers() if r.method in LEADERS]
    assert {r.method for r in rows} == LEADERS
    for method in LEADERS:
        tokens = {int(r.tokens.split()[0]) for r in rows if r.method == method and r.model == LLAVA}
        assert tokens in ({192, 128, 64}, {128, 64, 32}), (method, tokens)
    for row in rows:
        assert row.keep is not None and "arXiv:" in row.source, row
        assert row.value is not None or "unconfirmed" in row.note, row
        own = row.source.startswith(("MMTok arXiv:2508.18264 Table 1 (LLaVA-1.5-7B), MMTok row", "MMTok arXiv:2508.18264 Table 3"))
        assert own or "second-hand" in row.note or row.value is None, row
    mmtok = {(r.tokens, r.benchmark): r.value for r in rows if r.method == "mmtok" and r.model == LLAVA}
    assert mmtok[("64", "POPE")] == 85.77 and mmtok[("192", "MME")] == 1773.86  # MMTok Table 1
    rel5 = {r.keep: r.value for r in rows if r.method == "mmtok" and r.benchmark == "REL5"}
    assert rel5 == {0.2: 94.6, 0.1: 88.5, 0.05: 79.0}  # MMTok Table 3, Avg.


def test_the_leaders_rows_are_planned_with_the_release_presets(monkeypatch) -> None:
    """Each leader gets one run per budget, SparseVLM with its release preset (retain=N passed to the method); a
    leader this vtprune lacks (simulated: the registry without hiprune) is left out of the plan and refused by name,
    never a crash."""
    import vtprune

    registered = set(vtprune.list_methods())
    assert LEADERS <= registered
    runs = reproduce.plan(load_papers(), registered=registered)
    assert LEADERS <= {s.method for s in runs}
    without = registered - {"hiprune"}
    assert "hiprune" not in {s.method for s in reproduce.plan(load_papers(), registered=without)}
    monkeypatch.setattr(vtprune, "list_methods", lambda: sorted(without))
    with pytest.raises(SystemExit, match="--methods hiprune: not in this vtprune"):
        reproduce.main(["--print-commands", "--methods", "hiprune"])
    sparse = sorted((s for s in runs if s.method == "sparsevlm"), key=lambda s: s.keep)
    assert [s.options for s in sparse] == ["retain=64", "retain=128", "retain=192"]
    for setting in sparse:
        args = reproduce.model_args(setting, False, 8)
        assert f"{setting.options}," in args and "mmmu_val" in runs[setting]
        from lmms_eval.utils import simple_parse_args_string
        from vtprune.eval.lmms_plugin.args import parse_model_args

        parsed = simple_parse_args_string(args)
        prune = parse_model_args({k: v for k, v in parsed.items() if k not in ("pretrained", "dtype")}).prune
        assert prune.options["retain"] == int(setting.options.split("=")[1])


def test_scope_and_idpruner_rows_are_planned_and_say_what_runs() -> None:
    """SCOPE's and IDPruner's LLaVA-1.5-7B rows (no value yet: unconfirmed) plan one run per budget with the six
    benchmarks' tasks; IDPruner's say the run is vtprune's attention stand-in, not the paper's trained selector."""
    import vtprune

    rows = [r for r in load_papers() if r.method in ("scope", "idpruner")]
    assert {(r.method, r.tokens) for r in rows} == {(m, t) for m in ("scope", "idpruner") for t in ("192", "128", "64")}
    assert all(r.model == LLAVA and r.value is None and "unconfirmed" in r.note for r in rows)
    assert all("attention stand-in" in r.note and "not the paper's method" in r.note
               for r in rows if r.method == "idpruner")
    runs = reproduce.plan(load_papers(), methods=["scope", "idpruner"], registered=set(vtprune.list_methods()))
    for method in ("scope", "idpruner"):
        for keep in (0.333333, 0.222222, 0.111111):  # 192 / 128 / 64 of 576
            assert len(runs[Setting(LLAVA, method, keep)]) == 6, (method, keep)
