"""PrefixKV inside vLLM: each layer's KV entries of a request become its own kept subset after the prefill.

PrefixKV (Wang et al., arXiv:2412.03409) compresses the KV cache, it does not prune the sequence: every layer
computes over every token at prefill, as in vtprune's transformers path (:mod:`vtprune.kv`). Per step:

* layer 0's pre-hook reads the step's requests from the runner;
* each attention module's pre-hook (vLLM's ``Attention.forward(query, key, value)``, after RoPE) adds the attention
  that the request's prompt rows of this step pay each prompt key to the layer's priority
  (:func:`vtprune.kv_priority.received_attention`, the function PrefixKV's scorer sums with; a sum over rows, so a
  prompt prefilled in chunks sums its chunks) and holds the rows' keys and values until the prefill ends;
* when a prefill ends, the final norm's hook counts each layer's kept entries with vtprune's own
  :func:`vtprune.kv.layer_counts` and :func:`vtprune.layout.select_kept` and writes each layer's kept keys and
  values to the front of the request's slots with the backend's own ``do_kv_cache_update``;
* in later steps each decoder layer's pre-hook installs that layer's attention metadata: the request's sequence
  length there is its tokens minus the layer's evicted entries, new entries go right after the kept ones.

Decoding reads only the kept entries. After a preemption vLLM recomputes the request: the prompt runs again (every
layer over every prompt entry, as the first time), its rows are rewritten to each layer's kept entries of the first
prefill (kept in the request's record: no second selection), and vtprune's scheduler
(:mod:`vtprune.vllm.layerwise.retention_scheduler`) ends that step at the prompt's end, so the generated rows run in
later steps over each layer's kept entries, as their first decode did.

The memory is freed: every decoder layer is a KV cache group of its own (:func:`vtprune.vllm.layerwise.kv.use_retained_specs`).
When a prefill ends, the runner's block table rows of each layer are cut after its kept entries, and the counts go
to the scheduler in the step's output (:data:`REPORT`, rank 0's), whose layer managers return the same blocks to
vLLM's pool (:mod:`vtprune.vllm.layerwise.retention_scheduler`) before the next step is scheduled.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from vtprune.kv import evictable_mask, layer_counts
from vtprune.kv_priority import received_attention
from vtprune.layout import select_kept
from vtprune.plan import KVPlan
from vtprune.vllm import ranks
from vtprune.vllm.layerwise import ops, scoring
from vtprune.vllm.layerwise.decode import BuilderShift
from vtprune.vllm.layerwise.layout import RegionLayout, StepRequest, slot_mapping
from vtprune.vllm.layerwise.metadata import layer_group
from vtprune.vllm.layerwise.requests import request_keep, visual_positions

#: the attribute of a step's ``ModelRunnerOutput`` that carries ``{request id: entries each layer evicted}``
REPORT = "vtprune_evicted"


@dataclass
class RetentionRecord:
    """One request's retention on this worker: ``visual`` (prompt positions of its visual tokens), ``keep``; while
    its prefill runs, per layer the ``priority`` ``[P]`` summed so far, the earlier chunks' prompt ``keys`` (all
    heads, for scoring) and ``entries`` (this rank's keys and values of every row, for the rewrite); afterwards
    ``evicted``, the entries each layer dropped, and ``kept`` ``[layers, P]`` bool, each layer's kept prompt entries
    (kept through a preemption: a recompute rewrites the same entries)."""

    visual: torch.Tensor
    keep: float
    priority: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    entries: list = field(default_factory=list)
    evicted: tuple[int, ...] | None = None
    kept: torch.Tensor | None = None

    def reset(self, layers: int) -> None:
        """Start the prefill again (the request's first step, or a recompute after a preemption: ``kept`` stays)."""
        self.priority, self.evicted = [None] * layers, None
        self.keys, self.entries = [[] for _ in range(layers)], [[] for _ in range(layers)]


def query_rows(prompt: int, sampled: int | None) -> torch.Tensor:
    """``[Q]`` the prompt rows whose attention counts (PrefixKV's ``query_rows``): every row, or ``sampled`` evenly
    spaced ones, the last included, as :meth:`vtprune.scoring.ScoreContext.received_attention` picks them."""
    if sampled is None or sampled >= prompt:
        return torch.arange(prompt)
    steps = torch.linspace(0, 1, max(int(sampled), 1))
    return (steps * max(prompt - 1, 0)).round().long()


def prompt_chunk(computed: int, scheduled: int, prompt: int) -> int:
    """Tokens a request may run in one step under PrefixKV: ``scheduled``, cut at the prompt's end when the step
    would start inside the prompt and run past it (a recompute after a preemption: the generated rows must wait
    until every layer's kept entries are in place)."""
    return prompt - computed if computed < prompt < computed + scheduled else scheduled


class RetentionRuntime:
    """Hooks of one model served with ``prefixkv``: ``model`` (vLLM's multimodal model), the method's ``scorer``,
    the default ``keep``, the runner (weakly held) and the deque that records each prefill's kept tokens per layer."""

    def __init__(self, model: Any, scorer: Any, keep: float, runner: Any, selections: collections.deque) -> None:
        self.lm = model.get_language_model().model
        self.layers = scoring.VllmLayers(self.lm, getattr(model, "config", None))
        self.retention, self.sampled = scorer.kv_retention(), scorer.query_rows
        self.keep, self.selections, self.runner = keep, selections, weakref.ref(runner)
        self.attention = [layer.self_attn.attn for layer in self.layers.decoder_layers]
        self.records: dict[str, RetentionRecord | None] = {}
        self.steps: list[tuple[StepRequest, RetentionRecord | None]] | None = None
        self.prefilling: list[tuple[StepRequest, RetentionRecord]] = []
        self.handles = []
        # the hooks only call vtprune's ops (a compiled graph keeps the calls), which find this runtime by layer name
        self.names = [ops.register(self, attention) for attention in self.attention]
        for index, attention in enumerate(self.attention):
            self.handles.append(attention.register_forward_pre_hook(partial(self._attend_hook, index),
                                                                    with_kwargs=True))
        self.handles.append(self.lm.norm.register_forward_hook(self._end_hook))
        #: decode steps: each layer's group builds its own shifted metadata (no hook runs)
        self.shift = BuilderShift(runner, self._offsets, first_build=self._begin)
        #: request id -> entries each layer evicted, for this step's output (:meth:`_report`)
        self.reports: dict[str, tuple[int, ...]] = {}
        stock = runner.sample_tokens
        runner.sample_tokens = lambda *args, **kwargs: self._report(stock(*args, **kwargs))

    def _report(self, output: Any) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        if self.reports and isinstance(output, ModelRunnerOutput) and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            setattr(output, REPORT, self.reports)
            self.reports = {}
        return output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for attention in self.attention:
            ops.unregister(attention)
        self.shift.remove()
        runner = self.runner()
        if runner is not None:
            runner.__dict__.pop("sample_tokens", None)

    # -- the step -----------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Read the step's requests (before its first metadata build: the runner has prepared its inputs)."""
        self.steps, self.prefilling = None, []
        self.reports = {}  # the last step's went out with its output (rank 0) or nowhere (other ranks)
        runner = self.runner()
        batch = runner.input_batch if runner is not None else None
        count = batch.num_reqs if batch is not None else 0
        if count == 0:
            return
        starts = runner.query_start_loc.cpu[:count + 1].tolist()
        for gone in [rid for rid in self.records if rid not in runner.requests]:
            del self.records[gone]
        steps = []
        for index, request_id in enumerate(batch.req_ids[:count]):
            record = self._record(request_id, runner.requests[request_id])
            step = StepRequest(index, starts[index], starts[index + 1] - starts[index],
                               int(batch.num_computed_tokens_cpu[index]), int(batch.num_prompt_tokens[index]), (0, 0))
            if record is not None and (step.computed == 0 or (record.evicted and step.computed < step.prompt)):
                record.reset(len(self.attention))
            steps.append((step, record))
        self.prefilling = [(s, r) for s, r in steps if r is not None and s.computed < s.prompt]
        for step, _ in self.prefilling:
            if step.computed + step.scheduled > step.prompt:
                raise RuntimeError("vtprune: prefixkv got a step that runs a prompt and generated tokens together (a "
                                   "recompute); its scheduler (retention_scheduler.RetentionScheduler) must be in place.")
        decoding = any(r is not None and r.evicted is not None for _, r in steps)
        self.steps = steps if self.prefilling or decoding else None

    def _record(self, request_id: str, state: Any) -> RetentionRecord | None:
        if request_id not in self.records:
            visual = visual_positions(state.mm_features or [])
            keep = request_keep(state.mm_features or [], self.keep)
            self.records[request_id] = RetentionRecord(visual, keep) if visual.numel() and keep < 1.0 else None
        return self.records[request_id]

    def _offsets(self, gid: int) -> list[int] | None:
        """Per request of the step (batch order), the entries layer ``gid``'s group lacks for its decode rows."""
        if self.steps is None:
            return None
        layer = self.runner().kv_cache_config.kv_cache_groups[gid].kv_cache_spec.layer
        return [record.evicted[layer] if record is not None and record.evicted is not None
                and step.computed >= step.prompt else 0 for step, record in self.steps]

    def _attend_hook(self, index: int, module: Any, args: tuple, kwargs: dict) -> None:
        query, key, value = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
        torch.ops.vtprune.retention_attend(query, key, value, self.names[index], index)

    def _end_hook(self, module: Any, args: tuple, output: Any) -> None:
        torch.ops.vtprune.retention_end(output[0] if isinstance(output, tuple) else output, self.names[0])

    def attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Priority and entries of the prefilling requests' rows at decoder layer ``index`` (``retention_attend``)."""
        if self.steps is None or not self.prefilling:
            return
        size = self.attention[index].head_size
        for step, record in self.prefilling:
            rows = slice(step.start, step.start + step.scheduled)
            local_keys = key[rows].reshape(step.scheduled, -1, size)
            record.entries[index].append((local_keys.clone(), value[rows].reshape(step.scheduled,
                                                                                   local_keys.shape[1], -1).clone()))
            if record.kept is None:  # a recompute reuses the first prefill's kept entries
                self._add_priority(index, step, record, query[rows], key[rows])

    def _add_priority(self, index: int, step: StepRequest, record: RetentionRecord, query: torch.Tensor,
                      key: torch.Tensor) -> None:
        """Add the attention of this step's prompt rows to layer ``index``'s priority of the prompt keys."""
        count = min(step.scheduled, step.prompt - step.computed)
        size = self.attention[index].head_size
        keys = scoring._gather_heads(key[:count]).reshape(count, -1, size)
        earlier = record.keys[index]
        current = keys
        keys = torch.cat([*earlier, current]) if earlier else current  # [prompt rows so far, H_kv, d]
        if step.computed + step.scheduled < step.prompt:
            earlier.append(current.clone())  # later chunks attend to these keys (a copy: compiled graphs reuse buffers)
        rows = query_rows(step.prompt, self.sampled)
        rows = rows[(rows >= step.computed) & (rows < step.computed + count)]
        if record.priority[index] is None:
            record.priority[index] = torch.zeros(step.prompt, dtype=torch.float32, device=key.device)
        if rows.numel() == 0:
            return
        queries = scoring._gather_heads(query[rows - step.computed]).reshape(rows.numel(), -1, size)
        scaling = float(getattr(self.layers.decoder_layers[index].self_attn, "scaling", size ** -0.5))
        summed = received_attention(queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], rows[None],
                                    torch.ones(1, rows.numel(), dtype=torch.bool),
                                    torch.ones(1, keys.shape[0], dtype=torch.bool), scaling)
        record.priority[index][:keys.shape[0]] += summed[0]

    def end(self) -> None:
        """Each prompt whose prefill ended keeps its entries (``retention_end``)."""
        if self.steps is None:
            return
        for step, record in self.prefilling:
            if step.computed + step.scheduled >= step.prompt:
                self._retain(step, record)
        self.steps, self.prefilling = None, []

    # -- after a prefill ----------------------------------------------------------------------------------------
    def _kept(self, step: StepRequest, record: RetentionRecord) -> torch.Tensor:
        """``[layers, P]`` bool: each layer's kept prompt entries (vtprune's counts and selection; rank 0's)."""
        device = record.priority[0].device
        priorities = torch.stack(record.priority)[:, None, :]  # [layers, 1, P]
        visual = torch.zeros(1, step.prompt, dtype=torch.bool, device=device)
        visual[0, record.visual.to(device)] = True
        valid = torch.ones_like(visual)
        evictable = evictable_mask(SimpleNamespace(visual=visual, valid=valid), self.retention.scope,
                                   self.retention.start)
        counts, _, available = layer_counts(KVPlan(retention=self.retention, keep=record.keep), priorities,
                                            evictable, valid)
        layers = len(counts)  # one selection, the layers as its batch (each row its own count)
        masks = select_kept(priorities[:, 0], evictable.expand(layers, -1), valid.expand(layers, -1),
                            torch.tensor([c[0] for c in counts], device=device), width=available[0],
                            k_max=max(c[0] for c in counts))
        return ranks.broadcast_from_first_rank(masks.to(torch.uint8)).bool()

    def _retain(self, step: StepRequest, record: RetentionRecord) -> None:
        """Write each layer's kept entries to the front of the request's slots (after a recompute: the first
        prefill's)."""
        first = record.kept is None
        kept = self._kept(step, record) if first else record.kept
        runner = self.runner()
        evicted, ordinals = [], []
        ordinal = torch.full((step.prompt,), -1, dtype=torch.long)
        ordinal[record.visual] = torch.arange(record.visual.numel())
        request_id = runner.input_batch.req_ids[step.index]
        for layer, attention in enumerate(self.attention):
            rows = kept[layer].nonzero().flatten().cpu()
            chunks = record.entries[layer]
            keys, values = chunks[0] if len(chunks) == 1 else (torch.cat([k for k, _ in chunks]),
                                                               torch.cat([v for _, v in chunks]))
            gid, _ = layer_group(runner, attention.layer_name)
            table = runner.input_batch.block_table[gid]
            layout = RegionLayout([step.index], [rows.numel()], [rows.numel()], torch.arange(rows.numel()))
            slots = slot_mapping(table.block_table.gpu, table.block_size, layout).to(keys.device)
            device_rows = rows.to(keys.device)
            attention.impl.do_kv_cache_update(attention, keys[device_rows], values[device_rows], attention.kv_cache,
                                              slots)
            cut_blocks(runner, request_id, step.index, gid, rows.numel())
            evicted.append(step.prompt - rows.numel())
            picked = ordinal[rows]
            ordinals.append(picked[picked >= 0].tolist())
        record.evicted, record.kept = tuple(evicted), kept
        self.reports[request_id] = record.evicted
        record.priority, record.keys, record.entries = [], [], []
        if first:
            self.selections.append(ordinals)


def cut_blocks(runner: Any, request_id: str, row: int, gid: int, entries: int) -> None:
    """Cut the request's blocks of KV cache group ``gid`` after its first ``entries`` slots, in the runner's state
    and in its block table row ``row`` (the scheduler frees the same blocks when it reads this step's report)."""
    spec_size = runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
    del runner.requests[request_id].block_ids[gid][-(-entries // spec_size):]
    table = runner.input_batch.block_table[gid]
    keep = -(-entries // table.block_size)
    table.block_table.np[row, keep:table.num_blocks_per_row[row]] = 0
    table.num_blocks_per_row[row] = min(int(table.num_blocks_per_row[row]), keep)
