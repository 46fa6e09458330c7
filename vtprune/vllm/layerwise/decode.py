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


def shifted_rows(tables: torch.Tensor, block_size: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 shifts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``G`` groups' decode shift at once: ``([G, R] sequence lengths, [G, T] int64 KV slots of the new rows)``.

    ``tables`` ``[G, R, W]`` the groups' block tables (device), ``query_start_loc`` ``[R + 1]`` on the host,
    ``seq_lens`` ``[R]`` unshifted (device), ``shifts`` ``[G, R]`` on the host: the entries each group lacks per
    request. Row ``j`` of request ``r`` goes to KV position ``p = seq_lens[r] - shifts[g, r] - q_r + j``, slot
    ``tables[g, r, p // B] * B + p % B``. A few kernels per step whatever ``G`` (no host read of device values)."""
    count = shifts.shape[1]
    starts = query_start_loc[:count + 1].long()
    lengths = starts.diff()
    request = torch.repeat_interleave(torch.arange(count), lengths)
    tail = torch.arange(int(starts[-1])) - starts[1:].repeat_interleave(lengths)  # j - q_r, in [-q_r, 0)
    device = tables.device
    shifted = seq_lens[:count].long()[None] - shifts.to(device, torch.long)  # [G, R]
    request = request.to(device)
    positions = shifted[:, request] + tail.to(device)  # [G, T]
    groups = torch.arange(tables.shape[0], device=device)[:, None]
    blocks = tables[groups, request[None], positions // block_size]
    return shifted, blocks.long() * block_size + positions % block_size


def shifted_metadata(common: Any, offsets: list[int] | None, seq_buffer: torch.Tensor,
                     rows: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
    """A copy of ``common`` (vLLM's ``CommonAttentionMetadata``) whose sequence lengths are ``offsets`` lower
    (``seq_buffer``: the group's persistent ``[max_reqs]`` buffer, which holds them); ``rows``: the group's
    ``([R] shifted lengths, [T] slots)`` from :func:`shifted_rows`. With any offset, the new rows' slots are
    written in place in ``common.slot_mapping`` (the forward context's tensor for the group's layers)."""
    count = common.num_reqs
    out = copy.copy(common)
    out.seq_lens = seq_buffer[:count]
    for cache in ("_num_computed_tokens_cache", "_token_to_req_indices_cache"):
        if hasattr(out, cache):
            setattr(out, cache, None)
    if not offsets or not any(offsets) or rows is None:
        out.seq_lens.copy_(common.seq_lens)
        return out
    lengths, slots = rows
    out.seq_lens.copy_(lengths)
    upper = getattr(common, "seq_lens_cpu_upper_bound", None)
    if upper is not None:
        shift = torch.zeros(count, dtype=upper.dtype)
        shift[:len(offsets)] = torch.tensor(offsets, dtype=upper.dtype)
        out.seq_lens_cpu_upper_bound = upper - shift
        out.max_seq_len = int(out.seq_lens_cpu_upper_bound[:count].max())
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
        self.step: tuple[tuple[int, int], dict] | None = None  # (batch shape, the step's offsets and rows per group)
        self.gids: list[int] = []  # the wrapped groups
        self.builders: list[Any] = []
        self.stock = {name: runner.__dict__.get(name) for name in ("execute_model", "capture_model")}
        execute = runner.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            self.wrap()
            self.live, self.began, self.common, self.step = True, False, None, None
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
            self.gids.append(gid)
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
        if not self.live:
            return shifted_metadata(common, None, self._buffer(gid, common), None)
        key = (common.num_reqs, common.num_actual_tokens)
        if self.step is None or self.step[0] != key:  # once per step (again if the runner builds another batch)
            self.step = (key, self._step_rows(common))
        offsets, rows = self.step[1].get(gid, (None, None))
        return shifted_metadata(common, offsets, self._buffer(gid, common), rows)

    def _step_rows(self, common: Any) -> dict[int, tuple[list[int], Any]]:
        """Group id -> ``(offsets, rows)`` of every wrapped group for the step being built: the shifted groups'
        lengths and slots in one :func:`shifted_rows` per block layout (``rows`` None where nothing shifts)."""
        batch = self.runner.input_batch
        count = common.num_reqs
        out, layouts = {}, {}
        for gid in self.gids:
            offsets = self.offsets(gid)
            out[gid] = (offsets, None)
            if offsets and any(offsets):
                table = batch.block_table[gid]
                layouts.setdefault((table.block_size, table.block_table.gpu.shape[-1]), []).append((gid, offsets))
        for (block_size, _), shifted in layouts.items():
            shifts = torch.zeros(len(shifted), count, dtype=torch.long)
            for row, (_, offsets) in enumerate(shifted):
                shifts[row, :len(offsets)] = torch.tensor(offsets, dtype=torch.long)
            tables = torch.stack([batch.block_table[gid].block_table.gpu[:count] for gid, _ in shifted])
            lengths, slots = shifted_rows(tables, block_size, common.query_start_loc_cpu, common.seq_lens, shifts)
            for row, (gid, offsets) in enumerate(shifted):
                out[gid] = (offsets, (lengths[row], slots[row]))
        return out

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
        self.gids.clear()
        for name, stock in self.stock.items():
            if stock is None:
                self.runner.__dict__.pop(name, None)
            else:
                setattr(self.runner, name, stock)
