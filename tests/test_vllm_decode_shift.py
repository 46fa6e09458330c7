"""Hook-free decode metadata (``vtprune.vllm.layerwise.decode``), without vLLM: a hand case, the hooks' layout rule,
several KV groups at once against each alone, and what is written where."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vtprune.vllm.layerwise.decode import shifted_metadata, shifted_rows
from vtprune.vllm.layerwise.layout import StepRequest, region_layout, slot_mapping


def slots_of(table, block_size, starts, seq_lens, shifts=None):
    """One group's slots (``shifted_rows`` with G = 1; ``seq_lens`` already shifted unless ``shifts``)."""
    shifts = torch.zeros(1, len(seq_lens), dtype=torch.long) if shifts is None else torch.tensor([shifts])
    return shifted_rows(table[None], block_size, starts, torch.tensor(seq_lens), shifts)[1][0]


def test_slots_by_hand():
    table = torch.tensor([[5, 7], [2, 9]])
    # request 0: one row, shifted length 6 -> KV position 5 -> block 7, offset 1; request 1: rows at 1 and 2 of block 2
    assert slots_of(table, 4, torch.tensor([0, 1, 3]), [6, 3]).tolist() == [7 * 4 + 1, 2 * 4 + 1, 2 * 4 + 2]
    assert slots_of(table, 4, torch.tensor([0, 1, 3]), [9, 3], shifts=[3, 0]).tolist() == [7 * 4 + 1, 9, 10]


def test_slots_equal_the_layout_rule_for_decode_rows():
    """Decode rows of pruned requests (and an unpruned one) in region 1: the builders' slots equal the hooks'."""
    table = torch.arange(60).reshape(3, 20)[:, torch.randperm(20, generator=torch.Generator().manual_seed(0))]
    steps = [StepRequest(0, 0, 1, 70, 60, (0, 25)), StepRequest(1, 1, 3, 41, 30, (0, 9)),
             StepRequest(2, 4, 1, 12, 10, (0, 0))]
    layout = region_layout(steps, 1)
    want = slot_mapping(table, 8, layout)
    starts = torch.tensor([0, 1, 4, 5])
    assert torch.equal(slots_of(table, 8, starts, layout.seq_lens), want)
    unshifted = [s.computed + s.scheduled for s in steps]
    assert torch.equal(slots_of(table, 8, starts, unshifted, shifts=[25, 9, 0]), want)


def test_groups_at_once_equal_each_group_alone():
    """Three groups (their own block tables and offsets, a padded request of no rows) in one call equal three calls."""
    generator = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(40, generator=generator).reshape(4, 10) for _ in range(3)])
    starts, seq_lens = torch.tensor([0, 1, 4, 5, 5]), torch.tensor([38, 33, 12, 0])
    shifts = torch.tensor([[20, 5, 0, 0], [0, 0, 0, 0], [31, 17, 3, 0]])
    lengths, slots = shifted_rows(tables, 4, starts, seq_lens, shifts)
    assert lengths.tolist() == (seq_lens[None] - shifts).tolist()
    for g in range(3):
        alone = shifted_rows(tables[g:g + 1], 4, starts, seq_lens, shifts[g:g + 1])[1][0]
        assert torch.equal(slots[g], alone)
        position = int(seq_lens[0] - shifts[g, 0]) - 1  # request 0's one row, by hand
        assert int(slots[g, 0]) == int(tables[g, 0, position // 4]) * 4 + position % 4


def common(seq_lens, starts, slots):
    return SimpleNamespace(num_reqs=len(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
                           query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32), max_seq_len=max(seq_lens),
                           slot_mapping=slots, _num_computed_tokens_cache=torch.ones(1))


def test_metadata_is_shifted_in_the_groups_buffer_and_slots_in_place():
    table = torch.tensor([[3, 4], [6, 8]])
    slots = torch.tensor([0, 0, 0, -1])  # the runner's view: 3 rows and a padded one
    buffer = torch.full((4,), 99, dtype=torch.int32)
    original = common([9, 5], [0, 1, 3], slots)
    rows = shifted_rows(table[None], 4, original.query_start_loc_cpu, original.seq_lens, torch.tensor([[4, 0]]))
    out = shifted_metadata(original, [4, 0], buffer, (rows[0][0], rows[1][0]))
    assert out.seq_lens.data_ptr() == buffer.data_ptr() and out.seq_lens.tolist() == [5, 5]
    assert out.seq_lens_cpu_upper_bound.tolist() == [5, 5] and out.max_seq_len == 5
    assert out._num_computed_tokens_cache is None
    assert slots.tolist() == [4 * 4 + 0, 6 * 4 + 3, 8 * 4 + 0, -1]  # written in place; the padded row untouched
    assert original.seq_lens.tolist() == [9, 5] and original.max_seq_len == 9  # the runner's own metadata unchanged


def test_nothing_shifted_keeps_the_slots_and_copies_the_lengths():
    slots = torch.tensor([11, 12])
    buffer = torch.zeros(8, dtype=torch.int32)
    for offsets in (None, [0, 0]):
        out = shifted_metadata(common([7, 3], [0, 1, 2], slots), offsets, buffer, None)
        assert out.seq_lens.tolist() == [7, 3] and out.seq_lens.data_ptr() == buffer.data_ptr()
        assert slots.tolist() == [11, 12] and out.max_seq_len == 7
