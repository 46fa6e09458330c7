"""PrefixKV's priority computed one block of query rows at a time (``vtprune.kv_priority.received_attention``: each
row's softmax over the keys it sees, weighted column sums; Triton's two-pass kernel on CUDA) against a hand-computed
case and the whole softmax matrix (float64): causal rows, grouped-query heads, ragged rows and keys, repeated and
unsorted positions, several block sizes; and PrefixKV's kept entries on tiny models equal those from the earlier
softmax-per-chunk priority (``vtprune.scoring.received_attention_sum``)."""

from __future__ import annotations

import math

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.kv_priority import received_attention, received_attention_reference
from vtprune.methods import prefixkv
from vtprune.models.tiny import tiny_inputs, tiny_model

torch.set_num_threads(1)


def test_two_rows_by_hand():
    # one head, d = 1: row 0 sees key 0 alone (1.0); row 1 pays key 0 and key 1 scores 0 and ln 3: 1/4 and 3/4
    query = torch.tensor([[[[1.0], [1.0]]]])
    key = torch.tensor([[[[0.0], [math.log(3.0)]]]])
    ones = torch.ones(1, 2, dtype=torch.bool)
    for block in (1, 2, 64):
        got = received_attention(query, key, torch.tensor([[0, 1]]), ones, ones, 1.0, block)
        torch.testing.assert_close(got, torch.tensor([[1.25, 0.75]]))
    # a row that sees no valid key adds nothing; an invalid row adds nothing
    keys_valid = torch.tensor([[False, True]])
    got = received_attention(query, key, torch.tensor([[0, 1]]), ones, keys_valid, 1.0, 1)
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0]]))
    got = received_attention(query, key, torch.tensor([[0, 1]]), torch.tensor([[True, False]]), ones, 1.0, 1)
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0]]))


CASES = [  # batch, query heads, key heads, rows, keys
    (1, 2, 2, 6, 6),
    (2, 4, 2, 7, 9),  # grouped-query attention, more keys than rows
    (2, 6, 3, 5, 11),
    (1, 8, 1, 13, 13),  # one key head for eight query heads
]


@pytest.mark.parametrize("batch, heads, kv_heads, rows, keys", CASES)
@pytest.mark.parametrize("block", [1, 2, 3, 5, 256])
def test_blocks_equal_the_softmax_matrix(batch, heads, kv_heads, rows, keys, block):
    generator = torch.Generator().manual_seed(rows * 100 + keys + block)
    query = torch.randn(batch, heads, rows, 8, generator=generator)
    key = torch.randn(batch, kv_heads, keys, 8, generator=generator)
    # ragged: each sample its own rows (sampled positions, some invalid) and its own padded keys
    positions = torch.sort(torch.randint(0, keys, (batch, rows), generator=generator), dim=1).values
    rows_valid = torch.rand(batch, rows, generator=generator) > 0.25
    keys_valid = torch.rand(batch, keys, generator=generator) > 0.2
    want = received_attention_reference(query, key, positions, rows_valid, keys_valid, 0.4)
    got = received_attention(query, key, positions, rows_valid, keys_valid, 0.4, block)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the prompt's causal rows, every row valid: each row's attention sums to 1, so the keys get `rows` in all
    causal = torch.arange(keys)[None, -rows:].expand(batch, -1) if keys >= rows else None
    if causal is not None:
        ones_q, ones_k = torch.ones(batch, rows, dtype=torch.bool), torch.ones(batch, keys, dtype=torch.bool)
        got = received_attention(query, key, causal, ones_q, ones_k, 0.4, block)
        torch.testing.assert_close(got, received_attention_reference(query, key, causal, ones_q, ones_k, 0.4),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.sum(dim=1), torch.full((batch,), float(rows)))


@pytest.mark.parametrize("block", [1, 3, 4, 256])
def test_rows_at_their_positions_need_no_host_read_and_equal_the_matrix(block):
    """A whole prompt's rows (row q at position q, padded keys and rows): the spans come from the shapes."""
    generator = torch.Generator().manual_seed(block)
    query, key = torch.randn(2, 4, 9, 8, generator=generator), torch.randn(2, 2, 9, 8, generator=generator)
    positions = torch.arange(9)[None].expand(2, -1)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    want = received_attention_reference(query, key, positions, valid, valid, 0.3)
    got = received_attention(query, key, positions, valid, valid, 0.3, block, rows_at_positions=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rows_split_into_chunks_sum_to_the_whole():
    generator = torch.Generator().manual_seed(3)
    query, key = torch.randn(1, 4, 10, 8, generator=generator), torch.randn(1, 2, 10, 8, generator=generator)
    rows, ones = torch.arange(10)[None], torch.ones(1, 10, dtype=torch.bool)
    whole = received_attention(query, key, rows, ones, ones, 0.3, 4)
    first = received_attention(query[:, :, :4], key[:, :, :4], rows[:, :4], ones[:, :4], ones[:, :4], 0.3, 4)
    second = received_attention(query[:, :, 4:], key, rows[:, 4:], ones[:, 4:], ones, 0.3, 3)
    torch.testing.assert_close(torch.cat([first, torch.zeros(1, 6)], dim=1) + second, whole)


@pytest.mark.parametrize("block", [0, -1, 2.0, True])
def test_a_bad_block_is_refused_in_one_line(block):
    ones = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="must be a positive int") as error:
        received_attention(torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1), torch.tensor([[0, 1]]), ones, ones, 1.0,
                           block)
    assert "\n" not in str(error.value)


def _earlier_priority(ctx, rows=None):
    """The priority before the blockwise function: ``ScoreContext.received_attention`` (softmax per row chunk)."""
    return ctx.received_attention(rows)


@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_prefixkv_keeps_the_same_entries_as_with_the_softmax_per_chunk(model_type, monkeypatch):
    model, processor = tiny_model(model_type, "sdpa", image_size=112)
    inputs = tiny_inputs(processor, model_type, two_samples(model_type))
    kept = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(prefixkv, "priority", _earlier_priority)
        with vtprune.apply(model, "prefixkv", keep=0.4) as handle, torch.no_grad():
            model(**inputs)
            kept.append([[list(map(int, row)) for row in layer] for layer in handle.last_stats.kept_indices])
    assert kept[0] == kept[1]


@pytest.mark.parametrize("block", [1, 2, 4, 256])
def test_every_key_valid_with_repeated_and_unsorted_positions(block):
    """No padding (only the causal edge is masked): rows share positions and come in any order."""
    generator = torch.Generator().manual_seed(block + 7)
    query, key = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 2, 12, 8, generator=generator)
    positions = torch.tensor([[0, 0, 0, 1, 5, 3, 11, 2], [7, 7, 1, 0, 4, 4, 9, 10]])
    rows, keys = torch.ones(2, 8, dtype=torch.bool), torch.ones(2, 12, dtype=torch.bool)
    want = received_attention_reference(query, key, positions, rows, keys, 0.5)
    torch.testing.assert_close(received_attention(query, key, positions, rows, keys, 0.5, block), want,
                               atol=1e-5, rtol=1e-5)


def test_the_triton_kernel_equals_the_row_blocks():
    """``impl="triton"`` (CUDA's default; on a CPU through the interpreter the test conftest turns on): vtprune's
    two-pass kernel, its mean over the valid rows turned back into their sum, equals the matrix, padded keys and
    invalid rows included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(11)
    query, key = torch.randn(2, 4, 6, 16, generator=generator), torch.randn(2, 2, 9, 16, generator=generator)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 2, 5, 8, 8]])
    rows = torch.tensor([[True] * 6, [True, False, True, True, True, False]])
    keys = torch.ones(2, 9, dtype=torch.bool)
    keys[1, 1] = False
    want = received_attention_reference(query, key, positions, rows, keys, 0.25)
    on = [t.to(device) for t in (query, key, positions, rows, keys)]
    got = received_attention(*on, 0.25, impl="triton").cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(received_attention(query, key, positions, rows, keys, 0.25, impl="torch"), want,
                               atol=1e-5, rtol=1e-5)


def test_no_rows_or_no_keys_give_zeros():
    ones = torch.ones(1, 3, dtype=torch.bool)
    got = received_attention(torch.ones(1, 2, 0, 4), torch.ones(1, 2, 3, 4), torch.zeros(1, 0, dtype=torch.long),
                             torch.ones(1, 0, dtype=torch.bool), ones, 1.0)
    torch.testing.assert_close(got, torch.zeros(1, 3))
