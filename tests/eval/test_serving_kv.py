"""KV memory per served request (``vtprune bench serving``), by hand: 4 layers, 100 tokens of which 64 visual, blocks
of 16, 1 KV head of dimension 8, float32 (2 x 8 x 4 = 64 bytes per token and layer)."""

from __future__ import annotations

import pytest
from vtprune.eval.speed.serving_kv import kv_fields

CONFIG = {"num_hidden_layers": 4, "num_key_value_heads": 1, "head_dim": 8, "hidden_size": 64, "num_attention_heads": 8}


@pytest.mark.parametrize("method, tokens, read, blocks", [
    ("none", 100, 100, 7),  # ceil(100 / 16) = 7 blocks in every layer
    ("fastv", (100 + 100 + 52 + 52) / 4, (100 + 100 + 52 + 52) / 4, (7 + 7 + 4 + 4) / 4),  # layers 2, 3 keep 16 of 64
    ("prefixkv", 52, 52, 4),  # after the prefill every layer holds 16 of the 64 visual entries on average: 4 blocks
])
def test_kv_per_request_by_hand(method, tokens, read, blocks):
    row = kv_fields(method, 0.25, CONFIG, visual=64, tokens=100, block_size=16, budget_gib=1.0)
    assert row["kv_tokens_per_req"] == tokens and row["kv_read_tokens_per_req"] == read
    assert row["kv_blocks_per_req"] == blocks
    assert row["kv_mib_per_req"] == pytest.approx(blocks * 4 * 16 * 64 / 2**20, abs=1e-3)
