"""The pruned regions' attention metadata on a GPU backend's own metadata object, without a GPU or an engine.

The plugin builds each region's ``CommonAttentionMetadata`` (:func:`vtprune.vllm.layerwise.metadata.common_metadata`)
and hands it to the KV group's own metadata builder, so every backend plans from the same counts. Checked here:
the common metadata of a step with a final prefill, a decode and a plain request, by hand; and what vLLM's
FlashAttention builder makes of it (its ``FlashAttentionMetadata``: query starts, sequence lengths, block table
rows and slots of the region, cascade attention off). FlashInfer needs its CUDA package and runs in
``scripts/gpu_check.sh`` on a GPU; the CPU backend runs in every engine test.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vtprune.vllm.layerwise.layout import StepRequest, region_layout
from vtprune.vllm.layerwise.metadata import common_metadata


def fake_runner(table: torch.Tensor, block_size: int):
    """The runner attributes ``common_metadata`` reads: one KV group's block table in batch order."""
    group = SimpleNamespace(block_table=SimpleNamespace(gpu=table), block_size=block_size,
                            get_device_tensor=lambda count: table[:count])
    return SimpleNamespace(input_batch=SimpleNamespace(block_table=[group], num_reqs=table.shape[0]))


def step():
    """A final prefill (26 prompt tokens, 12 pruned: 14 rows from KV index 0), a decode of a pruned request (its
    27th token: KV index 27 - 12 - 1 = 14) and a plain request (3 tokens after 5)."""
    return [StepRequest(0, 0, 26, 0, 26, (0, 12)), StepRequest(1, 26, 1, 26, 26, (0, 12)),
            StepRequest(2, 27, 3, 5, 20, (0, 0))]


def test_common_metadata_of_a_region_by_hand():
    table = torch.tensor([[4, 0], [7, 8], [2, 0]], dtype=torch.int32)
    common = common_metadata(fake_runner(table, 16), 0, region_layout(step(), 1), torch.device("cpu"))
    assert common.query_start_loc.tolist() == [0, 14, 15, 18] and common.seq_lens.tolist() == [14, 15, 8]
    assert common.num_reqs == 3 and common.num_actual_tokens == 18
    assert common.max_query_len == 14 and common.max_seq_len == 15
    assert common.block_table_tensor.tolist() == table.tolist()
    assert common.slot_mapping.tolist() == [4 * 16 + i for i in range(14)] + [7 * 16 + 14, 2 * 16 + 5, 2 * 16 + 6,
                                                                               2 * 16 + 7]


def test_flash_attention_builds_the_regions_metadata():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    builder = FlashAttentionMetadataBuilder.__new__(FlashAttentionMetadataBuilder)
    builder.__dict__.update(aot_schedule=False, aot_sliding_window=(-1, -1), use_full_cuda_graph=False,
                            max_cudagraph_size=None, max_num_splits=0, dcp_world_size=1,
                            mm_prefix_query_ranges_np=None, rswa_window=None)
    table = torch.tensor([[4, 0], [7, 8], [2, 0]], dtype=torch.int32)
    common = common_metadata(fake_runner(table, 16), 0, region_layout(step()[1:], 1), torch.device("cpu"))
    metadata = builder.build(0, common)
    assert metadata.num_actual_tokens == 4 and metadata.max_query_len == 3 and metadata.max_seq_len == 15
    assert metadata.query_start_loc.tolist() == [0, 1, 4] and metadata.seq_lens.tolist() == [15, 8]
    assert metadata.block_table.tolist() == [[7, 8], [2, 0]]  # the region's requests' rows only
    assert metadata.slot_mapping.tolist() == [7 * 16 + 14, 2 * 16 + 5, 2 * 16 + 6, 2 * 16 + 7]
    assert not getattr(metadata, "use_cascade", False) and metadata.scheduler_metadata is None
