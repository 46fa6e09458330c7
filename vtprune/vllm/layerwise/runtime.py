"""The layer-wise methods inside vLLM's language model: per-instance hooks that score, select and compact.

vLLM seam: the decoder layers' ``forward(positions, hidden_states, residual)`` and the language model's final
``norm`` (vLLM calls the language model's ``forward`` directly, so hooks go on its parts). Per step:

* layer 0's pre-hook reads the step's requests from the runner (:mod:`vtprune.vllm.layerwise.records`) and installs
  the pruned regions' attention metadata (:mod:`vtprune.vllm.layerwise.metadata`);
* the pre-hook of a score layer below its stage scores the requests whose prompt ends in this step;
* the pre-hook of a stage layer keeps each such request's selected prompt rows (original positions), stashes the rows
  of a prompt chunk that does not end here, and hands the layer the compacted ``(positions, hidden, residual)``;
* the final norm's hook puts each request's rows back at its scheduled positions (a pruned visual position's row is
  zero: the runner reads the last row of a request, and prompt log-probabilities of kept tokens stay exact).

A step of decode rows only (with or without unpruned requests) runs no hook: the pruned regions' groups built their
own shifted metadata before the forward (:mod:`vtprune.vllm.layerwise.decode`).

Scores are the method's own (``scorer.score`` on a :class:`vtprune.scoring.ScoreContext`), captures the method's own
:class:`vtprune.methods.base.Capture` functions, called per request on its rows in vtprune's ``[1, L, ...]`` layout.
"""

from __future__ import annotations

import collections
import weakref
from functools import partial
from typing import Any

import torch

from vtprune.vllm import ranks
from vtprune.vllm.layerwise import layer_ops, ops
from vtprune.vllm.layerwise.decode import BuilderShift
from vtprune.vllm.layerwise.layout import StepRequest, region_layout
from vtprune.vllm.layerwise.metadata import ForwardContextSwap, step_batch
from vtprune.vllm.layerwise.plan import LayerPlan
from vtprune.vllm.layerwise.records import Chunk, RequestRecord, StepEntry
from vtprune.vllm.layerwise.requests import carried_keep
from vtprune.vllm.layerwise.scoring import RequestView, VllmLayers, score_context, select


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream a vLLM decoder layer reads (its ``hidden + residual``; layer 0 has no residual)."""
    return hidden if residual is None else hidden + residual


class LayerwiseRuntime:
    """Hooks of one served model: ``model`` (vLLM's multimodal model), its :class:`LayerPlan`, the model's default
    keep and the runner (a weak reference, found when the model was built)."""

    def __init__(self, model: Any, plan: LayerPlan, keep: float, runner: Any, selections: collections.deque) -> None:
        self.lm = model.get_language_model().model
        self.layers = VllmLayers(self.lm, getattr(model, "config", None))
        self.plan, self.keep, self.selections = plan, keep, selections
        self.runner = weakref.ref(runner)
        self.records: dict[str, RequestRecord | None] = {}
        self.entries: list[StepEntry] | None = None
        self.positions: torch.Tensor | None = None  # the current layout's positions (after the first stage)
        self.total = 0
        self.swap = ForwardContextSwap()
        #: decode steps: each pruned region's groups build their own shifted metadata (no hook runs)
        self.shift = BuilderShift(runner, self._offsets)
        self.stage_at = {stage.layer: index for index, stage in enumerate(plan.stages)}
        self.score_at = {layer: index for index, layer in enumerate(plan.score_layers) if layer != plan.layers[index]}
        self.merge_layer = plan.first_layer
        self.handles: list[Any] = []
        self.attention = [layer.self_attn.attn for layer in self.layers.decoder_layers]
        # the hooks only call vtprune's ops (layer_ops: a compiled graph keeps the calls), which find this runtime by
        # the name of the layer's attention module
        self.names = [ops.register(self, attention) for attention in self.attention]
        self.captured: list[tuple[Any, int]] = []  # (capture, layer) of each forward-hook capture, by number
        self._hook_layers()
        self._hook_captures()

    # -- hooks --------------------------------------------------------------------------------------------------
    def _hook_layers(self) -> None:
        """A pre-hook on layer 0, on every score and stage layer and on every layer above the first stage (the
        language model passes its own ``positions`` to each layer: those layers get the compacted ones)."""
        wanted = {0, *self.stage_at, *self.score_at}
        for index, layer in enumerate(self.layers.decoder_layers):
            if index in wanted or index > self.plan.layers[0]:
                self.handles.append(layer.register_forward_pre_hook(partial(self._before_layer, index),
                                                                    with_kwargs=True))
        self.handles.append(self.lm.norm.register_forward_hook(self._end))

    def _hook_captures(self) -> None:
        owner = {id(m): i for i, layer in enumerate(self.layers.decoder_layers) for m in layer.modules()}
        self.layer_captures: dict[int, list] = {}
        for capture in self.plan.scorer.captures(self.layers, self.plan.stages):
            index = owner.get(id(capture.module))
            if index is None:
                raise ValueError(f"vtprune: {self.plan.scorer.name} captures a module outside the decoder layers.")
            if self.plan.score_layers[0] < self.plan.layers[0] and index >= self.merge_layer:
                raise ValueError(f"vtprune: {self.plan.scorer.name} scores below its first stage and captures above "
                                 "it, which the vLLM plugin cannot stash across prompt chunks.")
            if capture.module is self.layers.decoder_layers[index]:
                if not capture.before:
                    raise ValueError(f"vtprune: {self.plan.scorer.name}: captures after a whole decoder layer are not "
                                     "supported in vLLM.")
                self.layer_captures.setdefault(index, []).append(capture)
                self.handles.append(capture.module.register_forward_pre_hook(
                    partial(self._run_layer_captures, index), with_kwargs=True))
            elif capture.before:
                raise ValueError(f"vtprune: {self.plan.scorer.name}: pre-hooks on a layer's parts are not supported.")
            else:
                self.captured.append((capture, index))
                self.handles.append(capture.module.register_forward_hook(
                    partial(self._capture_hook, len(self.captured) - 1, index)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for attention in self.attention:
            ops.unregister(attention)
        self.shift.remove()

    # -- the hooks: each only calls vtprune's ops (traced into a compiled graph), which call back below ----------
    def _before_layer(self, index: int, module: Any, args: tuple, kwargs: dict) -> Any:
        positions, hidden, residual = args[:3]
        name = self.names[index]
        if index == 0:
            layer_ops.layer_begin(hidden, name)
        if index > self.plan.layers[0]:
            positions = layer_ops.layer_positions(positions, hidden, name, index)
        if index in self.score_at:
            layer_ops.layer_input(positions, hidden, residual, name, index, "score")
        if index in self.stage_at:
            positions, hidden, residual = layer_ops.layer_stage(positions, hidden, residual, name, index)
        return (positions, hidden, residual, *args[3:]), kwargs

    def _end(self, module: Any, args: tuple, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        result = layer_ops.layer_end(hidden, self.names[0])
        return (result, *output[1:]) if isinstance(output, tuple) else result

    def _capture_hook(self, number: int, layer: int, module: Any, args: tuple, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        layer_ops.layer_capture(out, [a for a in args if isinstance(a, torch.Tensor)], self.names[layer], number)

    def _run_layer_captures(self, layer: int, module: Any, args: tuple, kwargs: dict) -> None:
        positions, hidden, residual = args[:3]
        layer_ops.layer_input(positions, hidden, residual, self.names[layer], layer, "capture")

    # -- the step -----------------------------------------------------------------------------------------------
    def _begin(self, total: int) -> None:
        """Read the step's requests; install the pruned regions' metadata when one of them prunes."""
        self.entries, self.total = None, total
        runner = self.runner()
        step = step_batch(runner)
        if step is None:
            return
        batch, starts = step
        count = batch.num_reqs
        if starts[-1] > total:
            return
        live = set(runner.requests)
        for gone in [rid for rid in self.records if rid not in live]:
            del self.records[gone]
        entries = []
        for index, request_id in enumerate(batch.req_ids[:count]):
            record = self._record(request_id, runner.requests[request_id])
            computed = int(batch.num_computed_tokens_cpu[index])
            if record is not None and computed == 0:
                record.reset()
            pruned = record.pruned if record is not None else (0,) * (len(self.plan.stages) + 1)
            step = StepRequest(index, starts[index], starts[index + 1] - starts[index], computed,
                               int(batch.num_prompt_tokens[index]), pruned)
            entries.append(StepEntry(step, record, step.start, step.scheduled,
                                     chunk=Chunk() if step.kind == "defer" else None))
        if all(entry.kind in ("plain", "decode") for entry in entries):
            return  # the regions' builders shifted the decode rows (BuilderShift)
        self.entries = entries

    def _offsets(self, gid: int) -> list[int] | None:
        """Per request of the step being built (batch order), the tokens region ``gid``'s group lacks for its decode
        rows (its pruned count; 0 for prompts and unpruned requests)."""
        runner = self.runner()
        region = runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.region
        batch = runner.input_batch
        out = []
        for index, request_id in enumerate(batch.req_ids[:batch.num_reqs]):
            record = self.records.get(request_id)
            decoding = int(batch.num_computed_tokens_cpu[index]) >= int(batch.num_prompt_tokens[index])
            out.append(record.pruned[region] if record is not None and decoding else 0)
        return out

    def _record(self, request_id: str, state: Any) -> RequestRecord | None:
        if request_id not in self.records:
            record = RequestRecord.create(self.plan, state.mm_features, state.prompt_token_ids, self.keep,
                                          carried_keep(getattr(state, "sampling_params", None)))
            self.records[request_id] = record if any(record.pruned) else None
        return self.records[request_id]

    # -- what the ops run (layer_ops) ----------------------------------------------------------------------------
    def begin(self, total: int) -> None:
        self._begin(total)

    def current_positions(self) -> torch.Tensor | None:
        """The positions of the current layout (after a stage compacted this step's rows), or None."""
        return self.positions if self.entries is not None else None

    def score_ahead(self, index: int, positions: torch.Tensor, hidden: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
        if self.entries is not None:
            self._score_ahead(self.score_at[index], index, positions, _stream(hidden, residual))

    def stage_rows(self, index: int, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Stage layer ``index``'s compacted ``(positions, hidden, residual)`` (new tensors), or None."""
        if self.entries is None:
            return None
        stage = self.stage_at[index]
        positions, hidden, residual = self._stage(stage, index, positions, hidden, residual)
        self.positions = positions
        layout = region_layout([entry.step for entry in self.entries], stage + 1)
        self.swap.install(self.runner(), stage + 1, layout, hidden.device)
        return positions, hidden, residual

    def end_rows(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows back at their scheduled positions (the runner samples each request's last scheduled row), or None."""
        if self.entries is None:
            return None
        result = hidden.new_zeros(self.total, hidden.shape[-1])
        for entry in self.entries:
            step, rows = entry.step, hidden[entry.start:entry.start + entry.rows]
            if entry.kind in ("plain", "decode"):
                result[step.start:step.start + step.scheduled] = rows
            elif entry.kind == "final":
                self._place_final(result, entry, rows)
            elif entry.kind == "defer" and entry.record is not None:
                entry.record.chunks.append(entry.chunk)
        self.entries, self.positions = None, None
        self.swap.restore()
        return result

    def _place_final(self, result: torch.Tensor, entry: StepEntry, rows: torch.Tensor) -> None:
        step, record = entry.step, entry.record
        extra = rows.shape[0] - record.view.index.numel()
        positions = torch.cat([record.view.index, torch.arange(step.prompt, step.prompt + extra)])
        inside = (positions >= step.computed) & (positions < step.computed + step.scheduled)
        result[step.start + positions[inside] - step.computed] = rows[inside.to(rows.device)]
        self.selections.append(record.view.ordinal[record.view.visual].tolist())
        record.reset()

    # -- scoring and compaction ---------------------------------------------------------------------------------
    def _context(self, entry: StepEntry, stage: int, layer: int, stream: torch.Tensor, positions: torch.Tensor):
        record = entry.record
        return score_context(self.layers, record.view, stream, positions, layer, record.stages[stage], stage,
                             record.kept[stage], record.num_visual, record.state, record.input_ids)

    def _score_ahead(self, stage: int, layer: int, positions: torch.Tensor, stream: torch.Tensor) -> None:
        """Scores of a stage whose score layer lies below it (FastV: layer K - 1), for the prompts ending now."""
        for entry in self.entries:
            if entry.kind not in ("defer", "final") or (stage > 0 and entry.kind == "defer"):
                continue
            record, rows = entry.record, slice(entry.start, entry.start + entry.prompt_rows())
            if entry.kind == "defer":
                entry.chunk.score_input = stream[rows].clone()
                continue
            if stage == 0:
                record.view = RequestView.whole_prompt(entry.step.prompt, record.visual)
                full = record.stacked("score_input", stream[rows])
                place = record.stacked("positions", positions[..., rows])
                record.state.update(record.chunk_captures(entry.captures))
            else:
                full, place = stream[rows], positions[..., rows]
            record.scores[stage] = self.plan.scorer.score(self._context(entry, stage, layer, full, place))

    def _stage(self, stage: int, layer: int, positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        start = 0
        for entry in self.entries:
            rows = slice(entry.start, entry.start + entry.rows)
            piece = (positions[..., rows], hidden[rows], residual[rows])
            if entry.kind == "defer" and stage == 0:
                piece = self._defer(entry, piece)
            elif entry.kind == "final":
                piece = self._keep(entry, stage, layer, piece)
            entry.start, entry.rows = start, piece[1].shape[0]
            entry.compacted = entry.compacted or entry.kind == "final"
            start += entry.rows
            parts.append(piece)
        return (torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts]),
                torch.cat([p[2] for p in parts]))

    def _defer(self, entry: StepEntry, piece: tuple) -> tuple:
        """Stash a chunk that does not end its prompt; one placeholder row goes on (its output is discarded)."""
        place, hidden, residual = piece
        count = entry.prompt_rows()
        chunk = entry.chunk
        # copies: ``positions`` is a view of the runner's buffer, which the next step overwrites
        chunk.positions, chunk.hidden = place[..., :count].clone(), hidden[:count].clone()
        chunk.residual = residual[:count].clone()
        chunk.captures = entry.captures
        return place[..., -1:], hidden[-1:], residual[-1:]

    def _keep(self, entry: StepEntry, stage: int, layer: int, piece: tuple) -> tuple:
        """The final step of a pruned prompt: the stage's kept prompt rows, then any generated rows."""
        record, (place, hidden, residual) = entry.record, piece
        count = entry.prompt_rows()
        extra = (place[..., count:], hidden[count:], residual[count:])
        place, hidden, residual = place[..., :count], hidden[:count], residual[:count]
        if stage == 0:
            if record.view is None:
                record.view = RequestView.whole_prompt(entry.step.prompt, record.visual)
                record.state.update(record.chunk_captures(entry.captures))
            place = record.stacked("positions", place)
            hidden, residual = record.stacked("hidden", hidden), record.stacked("residual", residual)
        scores = record.scores.pop(stage, None)
        if scores is None:
            scores = self.plan.scorer.score(self._context(entry, stage, layer, _stream(hidden, residual), place))
        kept = ranks.broadcast_from_first_rank(select(scores, record.view, record.kept[stage]))
        record.view = record.view.take(kept)
        device = hidden.device
        return (torch.cat([place[..., kept.to(place.device)], extra[0]], dim=-1),
                torch.cat([hidden[kept.to(device)], extra[1]]), torch.cat([residual[kept.to(device)], extra[2]]))

    # -- captures -----------------------------------------------------------------------------------------------
    def _targets(self, layer: int):
        """``(entry, state)`` of each request a capture at ``layer`` records for: below the merge layer every prompt
        being prefilled (per chunk), above it the prompts ending in this step (their method state)."""
        for entry in self.entries:
            if layer < self.merge_layer and entry.kind in ("defer", "final"):
                yield entry, entry.captures
            elif layer >= self.merge_layer and entry.kind == "final":
                yield entry, entry.record.state

    def capture(self, number: int, args: list[torch.Tensor], out: torch.Tensor) -> None:
        """Forward-hook capture ``number`` on a module's tensor ``args`` and output ``out``. The capture gets copies
        of its rows (it may keep them: in a compiled graph the tensors are buffers that later kernels reuse)."""
        if self.entries is None:
            return
        capture, layer = self.captured[number]
        module = capture.module
        for entry, state in self._targets(layer):
            rows = slice(entry.start, entry.start + entry.prompt_rows())
            sliced = tuple(a[rows].clone()[None] if isinstance(a, torch.Tensor) and a.shape[0] == out.shape[0] else a
                           for a in args)
            with torch.no_grad():
                capture.fn(state, module, sliced, {}, out[rows].clone()[None])

    def layer_captures_at(self, layer: int, positions: torch.Tensor, hidden: torch.Tensor,
                          residual: torch.Tensor | None) -> None:
        """The captures before decoder layer ``layer`` (on copies of their rows, as :meth:`capture`)."""
        if self.entries is None:
            return
        module = self.layers.decoder_layers[layer]
        stream = _stream(hidden, residual)
        for entry, state in self._targets(layer):
            rows = slice(entry.start, entry.start + entry.prompt_rows())
            for capture in self.layer_captures[layer]:
                with torch.no_grad():
                    capture.fn(state, module, (stream[rows].clone()[None],),
                               {"position_embeddings": positions[..., rows].clone()}, None)
