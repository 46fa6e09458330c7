"""``python -m vtprune.eval.speed.peers`` (vtprune vs AngelSlim's token_compressor) without AngelSlim installed:
the vtprune side is measured, the AngelSlim side is skipped with one line, and the CSV has its columns."""

from __future__ import annotations

import contextlib
import csv
import math

import pytest
import torch
from vtprune.eval.speed.peers import SKIP_LINE, main
from vtprune.eval.speed.peers_report import COLUMNS
from vtprune.eval.speed.peers_worker import (
    PAIRS,
    llava_mapping,
    standin_selector_folder,
    timed_run,
    vit_layers,
)

import vtprune
from vtprune.methods.idpruner import load_selector


@pytest.fixture(scope="module")
def embedded():
    from vtprune.eval.speed.peers import embedded_setup

    model, inputs, _, _ = embedded_setup(2)
    model.generation_config.eos_token_id = None
    return model, inputs


@pytest.mark.slow
def test_vtprune_side_runs_and_angelslim_is_skipped_in_one_line(tmp_path, capsys):
    """In this process, with the worker started on this python and a source folder without AngelSlim."""
    out = tmp_path / "out"
    code = main(["--models", "embedded", "--methods", "fastv,divprune", "--repeats", "1", "--samples", "2",
                 "--new-tokens", "3", "--angelslim-src", str(tmp_path / "no-angelslim"), "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    expected = SKIP_LINE.format(reason=f"--angelslim-src {str(tmp_path / 'no-angelslim')!r} holds no "
                                       "angelslim/compressor/token_compressor")
    assert expected in stdout.splitlines()
    with (out / "peers.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    assert [(r["model"], r["method"], r["side"]) for r in rows] == [
        ("embedded", "fastv", "vtprune"), ("embedded", "divprune", "vtprune")]
    for row in rows:
        assert row["status"] == "ok" and row["runs"] == "2"  # 1 round x 2 samples, warm-up excluded
        assert row["visual_tokens"] == "16" and row["kept_tokens"] == "4"  # 16 x 0.25, hand-computed
        assert row["angelslim_strategy"] == PAIRS[row["method"]].strategy
        for column in ("ttft_ms_p50", "e2e_ms_p50", "dense_e2e_ms_p50", "speedup_e2e"):
            assert math.isfinite(float(row[column])) and float(row[column]) > 0, column
        assert float(row["ttft_ms_p50"]) < float(row["e2e_ms_p50"])
        assert row["answers_equal_dense"].endswith("/2") and row["answers_equal_other"] == ""
        assert row["git_sha"] and row["date"]
    report = (out / "peers.md").read_text()
    assert "skipped: " in report and "transformers" in report and "| fastv (special_token_based_attention) |" in report
    assert (out / "peers.png").stat().st_size > 1000


def test_existing_results_are_not_overwritten_without_force(tmp_path, capsys):
    (tmp_path / "peers.csv").write_text("kept\n")
    with pytest.raises(SystemExit) as error:
        main(["--models", "embedded", "--methods", "fastv", "--out", str(tmp_path)])
    assert error.value.code == 2 and "--force" in capsys.readouterr().err
    assert (tmp_path / "peers.csv").read_text() == "kept\n"


def test_a_missing_angelslim_python_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        main(["--angelslim-python", str(tmp_path / "nope" / "python"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert error.value.code == 2 and "--angelslim-python" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("method", ["fastv", "divprune", "scope", "idpruner"])
def test_probe_counts_the_tokens_vtprune_reports_kept(embedded, method):
    """The last decoder layer's prefill length, minus the text, equals the engine's own kept count."""
    model, inputs = embedded
    handle = vtprune.wrap(model, method, keep=0.5, **PAIRS[method].options)
    try:
        run = timed_run(model, inputs[0], 2, contextlib.nullcontext)
        assert run["kept"] == handle.last_stats.kept[-1][0] == 8 and run["visual"] == 16
    finally:
        handle.remove()
    dense = timed_run(model, inputs[0], 2, contextlib.nullcontext)
    assert dense["kept"] == 16 and len(dense["tokens"]) == 2


def test_angelslim_settings_follow_the_model(embedded):
    """The feature layer -1 of the embedded tower (4 layers) is index 3; this transformers' CLIP path is flat."""
    model, _ = embedded
    assert vit_layers(model) == (3, 2)
    paths = [m["path"] for m in llava_mapping(model)]
    assert "model.vision_tower.encoder.layers[n].self_attn" in paths
    hiprune = PAIRS["hiprune"]
    assert hiprune.params(0.75, 22, 9) == {"ratio": 0.75, "object_layer": 9, "last_vit_layer": 22, "alpha": 0.1}


def test_scope_and_idpruner_follow_angelslims_configs():
    """AngelSlim's scope_r0.75.yaml / idpruner_r0.75.yaml at ratio 0.75, feature layer 22 (LLaVA-1.5's -2 of 24)."""
    assert PAIRS["scope"].params(0.75, 22, 9) == {"ratio": 0.75, "layer_idx": 22, "alpha": 1.0}
    assert PAIRS["scope"].needs(22, 9) == {"vit_q_layers": [22], "vit_k_layers": [22], "feature_map": True}
    params = PAIRS["idpruner"].params(0.75, 22, 9)
    assert {k: params[k] for k in ("ratio", "mmr_lambda", "parallel_k")} == {"ratio": 0.75, "mmr_lambda": 0.5,
                                                                              "parallel_k": 1}
    assert PAIRS["idpruner"].needs(22, 9) == {"inputs_embeds": True}


def test_idpruner_standin_selector_is_the_same_norm_on_both_sides():
    """The folder AngelSlim loads and vtprune's selector= both score a token by its embedding norm (hand-made)."""
    vision = torch.tensor([[[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]]])
    expected = torch.tensor([[5.0, 1.0, 10.0]])
    from_folder = load_selector(standin_selector_folder())  # AngelSlim's layout, loaded as vtprune loads it
    assert torch.allclose(from_folder(vision), expected)
    assert torch.allclose(PAIRS["idpruner"].options["selector"](vision), expected)
