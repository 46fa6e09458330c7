"""VisionZip's map on large Qwen-VL towers: the exact mean over all queries, or (``queries``) a sample of them.

Reference: the attention matrix written out per head with plain softmax, then averaged over the chosen rows.
"""

from __future__ import annotations

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.methods import tower
from vtprune.methods.tower import received_attention, spaced_rows, tower_rows
from vtprune.models.tiny import tiny_inputs, tiny_model


def _by_hand(query: torch.Tensor, key: torch.Tensor, scale: float, rows: list[int]) -> torch.Tensor:
    heads = query.shape[0]
    total = torch.zeros(key.shape[1])
    for h in range(heads):
        for i in rows:
            logits = [float(query[h, i] @ key[h, j]) * scale for j in range(key.shape[1])]
            top = max(logits)
            weights = torch.tensor([pow(2.718281828459045, v - top) for v in logits])
            total += weights / weights.sum()
    return total / (heads * len(rows))


def test_sampled_queries_average_the_attention_of_evenly_spaced_rows():
    torch.manual_seed(0)
    query, key = torch.randn(2, 11, 4), torch.randn(2, 11, 4)
    assert spaced_rows(11, 3).tolist() == [0, 5, 10]
    torch.testing.assert_close(received_attention(query, key, 0.5), _by_hand(query, key, 0.5, list(range(11))))
    torch.testing.assert_close(received_attention(query, key, 0.5, rows=3), _by_hand(query, key, 0.5, [0, 5, 10]))
    torch.testing.assert_close(received_attention(query, key, 0.5, rows=3, chunk=2), _by_hand(query, key, 0.5, [0, 5, 10]))
    torch.testing.assert_close(received_attention(query, key, 0.5, rows=50), received_attention(query, key, 0.5))


def test_auto_is_exact_up_to_the_threshold_and_samples_above():
    assert tower_rows("auto", tower.FAST_PATCHES) is None and tower_rows("all", 10**6) is None
    assert tower_rows("auto", tower.FAST_PATCHES + 4) == tower.FAST_ROWS == 1024
    assert tower_rows(300, 10) == 300


@pytest.mark.parametrize("value", [0, -3, True, "fast", 2.5])
def test_bad_queries_are_refused_at_wrap(value):
    model, _ = tiny_model("qwen2_vl")
    with pytest.raises(ValueError, match="queries="):
        vtprune.wrap(model, "visionzip", keep=0.5, queries=value)


def _kept(model, inputs, **options) -> list:
    with vtprune.apply(model, "visionzip", keep=0.25, **options) as handle, torch.no_grad():
        model(**inputs)
        return handle.last_stats.kept_indices[0]


def test_the_engine_uses_the_sampled_map_above_the_threshold(monkeypatch):
    model, processor = tiny_model("qwen2_vl")
    inputs = tiny_inputs(processor, "qwen2_vl", two_samples("qwen2_vl"))
    exact = _kept(model, inputs, queries="all")
    assert _kept(model, inputs) == exact  # small images: "auto" is the exact map
    sampled = _kept(model, inputs, queries=2)
    assert sampled != exact  # two queries rank differently on this random tower
    monkeypatch.setattr(tower, "FAST_PATCHES", 0)
    monkeypatch.setattr(tower, "FAST_ROWS", 2)
    assert _kept(model, inputs) == sampled
