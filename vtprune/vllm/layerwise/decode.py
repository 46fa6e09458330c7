"""Decode steps without hooks: each pruned KV cache group's own metadata builder shifts its requests' sequence
lengths and new KV slots, before the forward, as vLLM builds every group's metadata.

vLLM seams: the builders of the runner's attention groups (``runner.attn_groups[gid][i].get_metadata_builder(u)``,
whose ``build(common_prefix_len, common_attn_metadata, ...)`` every metadata build goes through, CUDA-graph capture
included), wrapped per builder instance; the runner's per-group slot mapping (``common_attn_metadata.slot_mapping``,
the tensor the forward context hands that group's layers), written in place; the runner's ``execute_model``, wrapped
per instance to mark the builds of a real step (profiling and capture runs build with nothing shifted); builds inside
the forward (a compacting step's hooks, :mod:`vtprune.vllm.layerwise.metadata`) pass through unchanged.

Groups of one spec share a build: vLLM builds the first group's metadata and, where the backend allows it
(``builder.supports_update_block_table``: FlashAttention), hands the others that metadata with their own block table
and slot mapping (``builder.update_block_table``). The shift of such a group (the same offsets: groups of one spec are
one layer-wise region) then only rewrites the group's own slots, in the wrapped ``update_block_table``.

A request that decodes in a group whose layers hold ``offset`` fewer entries than its tokens (a layer-wise method's
pruned region, or a PrefixKV layer after its prefill) sees sequence length ``tokens - offset`` there, and its new rows
go to KV positions ``offset`` lower. The shifted sequence lengths live in one persistent buffer per group, so a
captured CUDA graph reads the current step's values. Steps that compact a prompt still run the layer hooks
(:mod:`vtprune.vllm.layerwise.runtime`), which replace the regions' metadata after the compaction.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

#: a group's offsets for the step being built: ``offsets(gid) -> [num_reqs] entries fewer, or None (none shifted)``
Offsets = Callable[[int], "list[int] | None"]


def shifted_slots(block_table: torch.Tensor, block_size: int, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """``[tokens]`` int64 KV slots of each request's new rows: row ``j`` of request ``r`` (``query_start_loc`` ``[R
    + 1]`` on the host) at KV position ``seq_lens[r] - q_r + j`` (``seq_lens`` on the table's device, shifted), slot
    ``block_table[r, p // B] * B + p % B``. No host read of device values."""
    starts = query_start_loc[:num_reqs + 1].long()
    lengths = starts.diff()
    request = torch.repeat_interleave(torch.arange(num_reqs), lengths)
    within = torch.arange(int(starts[-1])) - starts[:-1].repeat_interleave(lengths)
    device = block_table.device
    request, within, lengths = request.to(device), within.to(device), lengths.to(device)
    positions = seq_lens.long()[request] - lengths[request] + within
    return block_table[request, positions // block_size].long() * block_size + positions % block_size


def shifted_metadata(common: Any, offsets: list[int] | None, seq_buffer: torch.Tensor, block_table: torch.Tensor,
                     block_size: int) -> Any:
    """A copy of ``common`` (vLLM's ``CommonAttentionMetadata``) whose sequence lengths are ``offsets`` lower
    (``seq_buffer``: the group's persistent ``[max_reqs]`` buffer, which holds them); with any offset, the new rows'
    slots are rewritten in place in ``common.slot_mapping`` (the forward context's tensor for the group's layers)."""
    count = common.num_reqs
    shift = torch.zeros(count, dtype=common.seq_lens.dtype)
    if offsets:
        shift[:len(offsets)] = torch.tensor(offsets, dtype=shift.dtype)
    out = copy.copy(common)
    out.seq_lens = seq_buffer[:count]
    out.seq_lens.copy_(common.seq_lens - shift.to(common.seq_lens.device))
    for cache in ("_num_computed_tokens_cache", "_token_to_req_indices_cache"):
        if hasattr(out, cache):
            setattr(out, cache, None)
    if not offsets or not any(offsets):
        return out
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        out.seq_lens_cpu_upper_bound = upper - shift.to(upper.dtype)
        out.max_seq_len = int(out.seq_lens_cpu_upper_bound[:count].max())
    slots = shifted_slots(block_table, block_size, common.query_start_loc_cpu, out.seq_lens, count)
    common.slot_mapping[:slots.numel()].copy_(slots)
    return out


class BuilderShift:
    """Wraps the metadata builders of the runner's KV cache groups ``gids`` (per instance, once): each build of a real
    step gets :func:`shifted_metadata` with ``offsets(gid)``; ``first_build`` (optional) runs before the step's first
    build. :meth:`remove` restores every wrapped builder and the runner."""

    def __init__(self, runner: Any, offsets: Offsets, first_build: Callable[[], None] | None = None) -> None:
        self.runner, self.offsets, self.first_build = runner, offsets, first_build
        self.live = self.began = False
        self.buffers: dict[int, torch.Tensor] = {}
        self.common: Any = None  # the last build's (unshifted) common metadata: what a shared build's groups share
        self.builders: list[Any] = []
        self.stock = {name: runner.__dict__.get(name) for name in ("execute_model", "capture_model")}
        execute = runner.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            self.wrap()
            self.live, self.began, self.common = True, False, None
            try:
                return execute(*args, **kwargs)
            finally:
                self.live = False

        runner.execute_model = execute_model
        capture = getattr(runner, "capture_model", None)
        if capture is not None:  # CUDA graphs must capture the wrapped builds (the groups' persistent buffers)

            def capture_model(*args: Any, **kwargs: Any) -> Any:
                self.wrap()
                return capture(*args, **kwargs)

            runner.capture_model = capture_model

    def wrap(self) -> None:
        """Wrap the builders of every group ``offsets`` may shift (those of a ``region`` or ``layer`` spec), once."""
        if self.builders:
            return
        for gid, groups in enumerate(getattr(self.runner, "attn_groups", None) or []):
            spec = self.runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            if not (getattr(spec, "region", 0) or hasattr(spec, "layer")):
                continue
            for group in groups:
                for builder in getattr(group, "metadata_builders", None) or [group.get_metadata_builder()]:
                    if "build" not in builder.__dict__:
                        builder.build = self._build(gid, builder.build)
                        builder.update_block_table = self._update(gid, builder.update_block_table)
                        self.builders.append(builder)

    def _build(self, gid: int, stock: Callable[..., Any]) -> Callable[..., Any]:
        def build(common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm.forward_context import is_forward_context_available

            if is_forward_context_available():  # a hook's own build inside the forward: already shifted
                return stock(common_prefix_len, common_attn_metadata, *args, **kwargs)
            if self.live and not self.began:
                self.began = True
                if self.first_build is not None:
                    self.first_build()
            self.common = common_attn_metadata
            return stock(common_prefix_len, self._shift(gid, common_attn_metadata), *args, **kwargs)

        return build

    def _update(self, gid: int, stock: Callable[..., Any]) -> Callable[..., Any]:
        def update_block_table(metadata: Any, block_table: Any, slot_mapping: torch.Tensor, *args: Any,
                               **kwargs: Any) -> Any:
            from vllm.forward_context import is_forward_context_available

            if self.common is not None and not is_forward_context_available():  # the step's shared build
                common = copy.copy(self.common)
                common.slot_mapping = slot_mapping
                self._shift(gid, common)  # the metadata's lengths are shifted already; this group's slots now too
            return stock(metadata, block_table, slot_mapping, *args, **kwargs)

        return update_block_table

    def _shift(self, gid: int, common: Any) -> Any:
        """``common`` shifted for group ``gid`` in a real step (its slots rewritten in place), else only copied."""
        table = self.runner.input_batch.block_table[gid]
        return shifted_metadata(common, self.offsets(gid) if self.live else None, self._buffer(gid, common),
                                table.block_table.gpu, table.block_size)

    def _buffer(self, gid: int, common: Any) -> torch.Tensor:
        buffer = self.buffers.get(gid)
        if buffer is None or buffer.numel() < common.num_reqs:
            size = max(common.num_reqs, int(getattr(self.runner, "max_num_reqs", 0) or 0))
            buffer = torch.zeros(size, dtype=common.seq_lens.dtype, device=common.seq_lens.device)
            self.buffers[gid] = buffer
        return buffer

    def remove(self) -> None:
        for builder in self.builders:
            builder.__dict__.pop("build", None)
            builder.__dict__.pop("update_block_table", None)
        self.builders.clear()
        for name, stock in self.stock.items():
            if stock is None:
                self.runner.__dict__.pop(name, None)
            else:
                setattr(self.runner, name, stock)
