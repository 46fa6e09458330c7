"""FLOP and KV-cache formulas, and the speed benchmark's pure helpers, against hand-computed values.

Toy LM: hidden d=4, MLP 8, 2 layers, 2 heads / 1 KV head (KV width 2), vocab 10. Per layer over n tokens:
n * (2 (16 + 2*4*2) + 2*16 + 6*4*8) + 4 n^2 * 4 = 288 n + 16 n^2; one decode token: 288 + 16 c for c keys;
the LM head: 2 * 4 * 10 = 80 per position.
"""

from __future__ import annotations

import pytest
from vtprune.eval.speed.measure import layer_lengths, percentiles, predict, split_prediction, spread

from vtprune.flops import (
    LMShape,
    decode_flops,
    decode_step_flops,
    generate_flops,
    kv_cache_bytes,
    layer_flops,
    prefill_flops,
)

SHAPE = LMShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, vocab=10)


def test_layer_and_prefill_flops():
    assert layer_flops(SHAPE, 2) == 288 * 2 + 16 * 4 == 640
    assert prefill_flops(SHAPE, [2, 4]) == 640 + (288 * 4 + 16 * 16) + 80 == 2128
    assert prefill_flops(SHAPE, [2, 4], batch=3) == 3 * 2128


def test_decode_step_flops_count_attention_over_the_keys_seen():
    # keys [3, 5]: (288 + 16*3) + (288 + 16*5) + 80
    assert decode_step_flops(SHAPE, [3, 5]) == 336 + 368 + 80 == 784
    assert decode_step_flops(SHAPE, [3, 5], batch=2) == 2 * 784


def test_generate_is_prefill_plus_n_minus_one_decode_steps():
    # after a prefill of [2, 4], step 1 sees [3, 5] keys (784), step 2 sees [4, 6]: 352 + 384 + 80 = 816
    assert decode_flops(SHAPE, [2, 4], new_tokens=1) == 0
    assert decode_flops(SHAPE, [2, 4], new_tokens=3) == 784 + 816
    assert generate_flops(SHAPE, [2, 4], new_tokens=3) == 2128 + 1600 == 3728
    assert generate_flops(SHAPE, [2, 4], new_tokens=3, batch=3) == 3 * 3728


def test_kv_cache_bytes():
    # 2 (K and V) * length * KV width 2 * 2 bytes, per layer
    assert kv_cache_bytes(SHAPE, [4, 6]) == 2 * 4 * 2 * 2 + 2 * 6 * 2 * 2 == 80
    assert kv_cache_bytes(SHAPE, [4, 6], bytes_per_value=4, batch=3) == 3 * 160


def test_layer_lengths_repad_to_the_longest_kept_sample():
    # samples: 3 text + 7 visual (10 tokens) and 4 text + 5 visual (9 tokens, one pad) -> prompt 10
    assert layer_lengths(4, 10, [3, 4], [7, 5], []) == [10, 10, 10, 10]
    assert layer_lengths(4, 10, [3, 4], [7, 5], [(2, [2, 4])]) == [10, 10, 8, 8]
    assert layer_lengths(4, 10, [3, 4], [7, 5], [(2, [2, 4]), (3, [1, 1])]) == [10, 10, 8, 5]


def test_predict_ratios_and_kv_bytes():
    out = predict(SHAPE, base=[4, 4], pruned=[2, 2], new_tokens=2, batch=1, bytes_per_value=2)
    prefill_base, prefill_pruned = 2 * (288 * 4 + 256) + 80, 2 * (288 * 2 + 64) + 80
    decode_base, decode_pruned = 2 * (288 + 80) + 80, 2 * (288 + 48) + 80  # keys 5 vs 3 per layer
    assert out["predicted_prefill"] == pytest.approx(prefill_base / prefill_pruned)
    assert out["predicted_decode"] == pytest.approx(decode_base / decode_pruned)
    assert out["predicted_e2e"] == pytest.approx((prefill_base + decode_base) / (prefill_pruned + decode_pruned))
    assert out["kv_bytes_predicted"] == 2 * (2 * 3 * 2 * 2)  # 2 prompt + 1 generated token cached per layer


def test_percentiles_and_spread():
    values = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert percentiles(values) == {20: 18.0, 50: 30.0, 80: 42.0}
    assert spread(values) == pytest.approx(42.0 / 18.0)
    assert spread([5.0]) == 1.0
    assert all(v != v for v in percentiles([]).values())


def test_split_prediction_weighs_decode_by_its_time():
    # baseline 1000 ms: prefill 600, rest 400; prefill 3x faster, decode 1.25x -> 200 + 320 = 520 ms
    assert split_prediction(1000.0, 600.0, 3.0, 1.25) == pytest.approx(1000.0 / 520.0)
    assert split_prediction(1000.0, 1000.0, 2.0, 1.0) == pytest.approx(2.0)
