"""``vtprune bench --speed`` end to end on a tiny geometry, and KV-cache bytes measured vs the formula."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from vtprune.eval.speed.bench import COLUMNS
from vtprune.eval.speed.measure import (
    generate_with_cache,
    kv_cache_measured,
    layer_lengths,
    output_cache,
    stages_of,
)

import vtprune
from vtprune.flops import LMShape, kv_cache_bytes

NUMERIC = [c for c in COLUMNS if c.endswith(("_ms_p20", "_ms_p50", "_ms_p80")) or c.startswith(
    ("speedup_", "predicted_", "efficiency_", "throughput", "kv_bytes"))]


@pytest.mark.slow
def test_speed_bench_writes_every_column_table_and_plots(tmp_path, cli):
    """In this process (``cli``); the peak memory is measured in the bench's own fresh subprocess."""
    code, _, err = cli("bench", "--speed", "--methods", "fastv", "--keep", "0.25", "--speed-tokens", "576",
                       "--speed-hidden", "128", "--speed-layers", "4", "--speed-batches", "1,2", "--speed-new-tokens",
                       "3", "--repeats", "2", "--threads", "1", "--out", str(tmp_path))
    assert code == 0, err[-3000:]
    with (tmp_path / "speed.csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == COLUMNS
    assert {(r["batch"], r["method"], float(r["keep"])) for r in rows} == {
        (b, m, k) for b in ("1", "2") for m, k in (("none", 1.0), ("fastv", 1.0), ("fastv", 0.25))}
    for row in rows:
        assert row["status"] == "ok"
        for column in NUMERIC:
            assert math.isfinite(float(row[column])), (column, row[column])
        assert float(row["kv_error_pct"]) == 0.0  # measured from the cache tensors = the formula
        assert float(row["peak_mem_mb"]) > 0 and row["mem_method"].startswith("cpu peak RSS")
        assert row["git_sha"] and row["weights_sha"] and row["device"].startswith("cpu")
    by = {(r["batch"], r["method"], float(r["keep"])): r for r in rows}
    assert by[("2", "none", 1.0)]["visual_per_sample"] == "576;1152"  # ragged: 1 and 2 images
    pruned = by[("1", "fastv", 0.25)]
    assert float(pruned["predicted_prefill"]) > 1.0 and float(pruned["kv_bytes"]) < float(pruned["kv_bytes_base"])
    assert pruned["kept_per_stage"] == "2:144"
    assert float(by[("1", "fastv", 1.0)]["syncs_decode_hooks"]) >= 0.0
    assert float(by[("1", "fastv", 1.0)]["hook_time_decode_us"]) > 0.0
    report = (tmp_path / "speed.md").read_text()
    assert report.startswith("| geometry |") and "Conditions:" in report and "Hook cost per decode step" in report
    for name in ("speedup_vs_keep.png", "memory_vs_visual.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_speed_bench_bad_geometry_is_a_clear_error(tmp_path, cli):
    code, _, err = cli("bench", "--speed", "--speed-tokens", "999", "--out", str(tmp_path))
    assert code == 2
    assert "--speed-tokens '999'" in err and "Traceback" not in err


@pytest.mark.parametrize("method", ["none", "fastv"])
def test_kv_cache_bytes_measured_equal_the_formula(method):
    """fastv at layer 2 of a 4-layer model: layers 0-1 cache the full prompt, layers 2-3 the kept tokens."""
    from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

    model, processor = tiny_model("llava")
    model.generation_config.eos_token_id = None
    samples = [("what color?", [random_image(56, 56, 0)]), ("how many?", [random_image(56, 56, 1)] * 2)]
    inputs = tiny_inputs(processor, "llava", samples)
    visual_mask = inputs["input_ids"] == model.config.image_token_id
    visual = visual_mask.sum(dim=1).tolist()
    text = (inputs["attention_mask"].bool() & ~visual_mask).sum(dim=1).tolist()
    prompt, new_tokens = inputs["input_ids"].shape[1], 3
    with vtprune.apply(model, "fastv", keep=0.25, layer=2) if method == "fastv" else _nothing() as handle:
        cache = output_cache(generate_with_cache(model, inputs, new_tokens))
        stages = stages_of(handle)
    measured, lengths = kv_cache_measured(cache)
    shape = LMShape.from_config(model.config)
    expected = layer_lengths(shape.layers, prompt, text, visual, stages)
    kept = [vtprune.keep_count(0.25, n) for n in visual]
    if method == "fastv":
        assert stages == [(2, kept)]
        assert expected[:2] == [prompt] * 2 and expected[2:] == [max(t + k for t, k in zip(text, kept))] * 2
    else:
        assert expected == [prompt] * 4
    assert lengths == [n + new_tokens - 1 for n in expected]
    assert measured == kv_cache_bytes(shape, lengths, 4, batch=2)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_layer_lengths_match_the_engine_on_a_padded_batch():
    """The prediction's repadding rule equals the cache the engine leaves (pdrop: three stages)."""
    from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

    model, processor = tiny_model("llava")
    samples = [("a?", [random_image(56, 56, 0)] * 2), ("b c d e?", [random_image(56, 56, 1)])]
    inputs = tiny_inputs(processor, "llava", samples)
    visual_mask = inputs["input_ids"] == model.config.image_token_id
    with vtprune.apply(model, "pdrop", keep=0.25) as handle, torch.inference_mode():
        out = model(**inputs, use_cache=True)
        stages = stages_of(handle)
    _, lengths = kv_cache_measured(getattr(out, "past_key_values", None))
    text = (inputs["attention_mask"].bool() & ~visual_mask).sum(dim=1).tolist()
    assert len(stages) > 1
    assert lengths == layer_lengths(4, inputs["input_ids"].shape[1], text, visual_mask.sum(dim=1).tolist(), stages)
