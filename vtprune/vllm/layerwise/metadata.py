"""Attention metadata and KV slots of the pruned layer regions, built by each KV group's own backend builder.

vLLM seam (``vllm.v1.attention.backend.CommonAttentionMetadata``, the runner's ``attn_groups``, ``input_batch``
and the forward context's per-layer ``attn_metadata`` / ``slot_mapping`` dicts): for every pruned region, a
``CommonAttentionMetadata`` of the region's rows (:class:`vtprune.vllm.layerwise.layout.RegionLayout`) goes through
the group's ``AttentionGroup.build_metadata`` (:func:`vtprune.vllm.versions.build_metadata`: vLLM 0.31 spells it
differently), so the CPU backend, FlashAttention and FlashInfer each build their own metadata (scheduler plans
included) from the same counts; the result and the region's slot mapping replace the
layers' entries in the forward context for one forward, then the runner's entries come back.
"""

from __future__ import annotations

from typing import Any

import torch

from vtprune.vllm.layerwise.layout import RegionLayout, slot_mapping
from vtprune.vllm.versions import build_metadata


def region_groups(runner: Any) -> dict[int, list[int]]:
    """Region -> the KV cache group ids whose layers hold it (groups of a ``PrunedAttentionSpec``)."""
    out: dict[int, list[int]] = {}
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        region = getattr(group.kv_cache_spec, "region", 0)
        if region:
            out.setdefault(region, []).append(gid)
    return out


def step_batch(runner: Any) -> tuple[Any, list[int]] | None:
    """``(input batch, [num_reqs + 1] query starts)`` of the step being run, or None for a dummy run (profiling, an
    idle data-parallel rank: no attention metadata, and the batch may be stale) or an empty batch."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if runner is None or not is_forward_context_available() or not get_forward_context().attn_metadata:
        return None
    batch = runner.input_batch
    count = batch.num_reqs if batch is not None else 0
    if count == 0:
        return None
    return batch, runner.query_start_loc.cpu[:count + 1].tolist()


def layer_group(runner: Any, layer_name: str) -> tuple[int, Any]:
    """``(KV cache group id, AttentionGroup)`` of the attention layer ``layer_name``."""
    for gid, groups in enumerate(runner.attn_groups):
        for attention_group in groups:
            if layer_name in attention_group.layer_names:
                return gid, attention_group
    raise RuntimeError(f"vtprune: attention layer {layer_name!r} is in no KV cache group (untested vLLM version?).")


def common_metadata(runner: Any, gid: int, layout: RegionLayout, device: torch.device) -> Any:
    """The ``CommonAttentionMetadata`` of ``layout``'s rows in KV cache group ``gid``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    table = runner.input_batch.block_table[gid]
    rows = torch.tensor(layout.indices, dtype=torch.long)
    block_table = table.get_device_tensor(runner.input_batch.num_reqs)[rows.to(device)]
    slots = slot_mapping(table.block_table.gpu, table.block_size, layout)
    query_start = layout.query_start_loc()
    seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start.to(device), query_start_loc_cpu=query_start, seq_lens=seq_lens.to(device),
        num_reqs=len(layout.indices), num_actual_tokens=layout.num_tokens, max_query_len=max(layout.query_lens),
        max_seq_len=max(layout.seq_lens), block_table_tensor=block_table, slot_mapping=slots.to(device),
        causal=True, seq_lens_cpu_upper_bound=seq_lens,
        is_prefilling=torch.tensor([q > 1 for q in layout.query_lens], device=device))


class ForwardContextSwap:
    """Replace the per-layer entries of the forward context for one forward (:meth:`restore` puts them back)."""

    def __init__(self) -> None:
        self.saved: list[tuple[dict, str, Any]] = []

    def install(self, runner: Any, region: int, layout: RegionLayout, device: torch.device) -> None:
        """Metadata and slot mapping of one pruned region's groups into the current forward context. Called just
        before the region's first layer runs: the CPU backend's attention plan must be the last one built before
        its kernel runs (building it earlier, before the layers below ran, corrupts their scratch space)."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if not isinstance(context.attn_metadata, dict) or not isinstance(context.slot_mapping, dict):
            raise RuntimeError("vtprune: layer-wise pruning does not run with micro-batching (DBO); turn it off.")
        for gid in region_groups(runner).get(region, []):
            common = common_metadata(runner, gid, layout, device)
            for attention_group in runner.attn_groups[gid]:
                metadata = build_metadata(attention_group, common)
                for name in attention_group.layer_names:
                    self._set(context.attn_metadata, name, metadata)
                    self._set(context.slot_mapping, name, common.slot_mapping)

    def _set(self, table: dict, name: str, value: Any) -> None:
        self.saved.append((table, name, table.get(name)))
        table[name] = value

    def restore(self) -> None:
        for table, name, value in reversed(self.saved):
            table[name] = value
        self.saved.clear()
