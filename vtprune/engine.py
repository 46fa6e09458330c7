"""The pruning engine: per-instance forward hooks that shrink the visual tokens inside the language model.

Hooks (all removed exactly by :meth:`PruneHandle.remove`):

* a pre-hook and an always-called forward hook on the whole model open and close a *frame* per forward
  (:mod:`vtprune.calls`): a prefill with visual tokens starts a new call; a forward whose cache holds a
  call's decode state continues that call; anything else runs unpruned;
* a pre-hook on the language model runs the pre-LLM stage (layer 0) and, while decoding, keeps the 2-D
  mask and position ids in step with a pruned layer-0 cache (:mod:`vtprune.prefill`, :mod:`vtprune.decode`);
* pre-hooks on decoder layers compute scores at the scoring layers, drop tokens at the stage layers, and
  hand every later layer the sliced mask, ``(cos, sin)`` and position ids.

Per-call state belongs to the call, never to the handle or the method: interleaved requests and threads
get the results of running alone, and nothing of a call outlives its cache.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vtprune import decode, guards, kv, outputs, prefill
from vtprune.adapters.base import Adapter
from vtprune.calls import CallRegistry, cache_of, cache_of_output
from vtprune.config import PruneConfig
from vtprune.errors import UserError
from vtprune.layout import visual_ordinals
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.debias import Debiased
from vtprune.plan import Plan, Wiring
from vtprune.state import CallState, CallStats, LazySegments, StageRecord, Timer

MAX_STATS = 1000
RECORD_INDICES = 8
PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
DEEPCOPY_MESSAGE = (
    "a model wrapped by vtprune cannot be deep-copied (its hooks belong to this handle): copy the model first "
    "and wrap the copy (`clone = copy.deepcopy(model); vtprune.wrap(clone, ...)`), or call handle.remove() first."
)
PICKLE_MESSAGE = "a model wrapped by vtprune cannot be pickled; call handle.remove() first and wrap it again after loading."


class PruneHandle:
    """A wrapped model's pruning hooks and statistics. Create it with :func:`vtprune.wrap`."""

    def __init__(self, model: nn.Module, adapter: Adapter, plan: Plan, config: PruneConfig,
                 record_indices: int = RECORD_INDICES) -> None:
        self.model, self.adapter, self.plan, self.config = model, adapter, plan, config
        self.scorer, self.stages = plan.scorer, plan.stages
        self.stats: deque[CallStats] = deque(maxlen=MAX_STATS)
        self.record_indices = int(record_indices)
        self.calls = CallRegistry()
        self.observers: list[Callable[[StageRecord], None]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._guards: list[Any] = []
        self._warned_training = False
        self.wiring = Wiring(plan, adapter, self.observers)  # what prefill / decode / kv read (never the handle)
        self._register()

    @property
    def method(self) -> Scorer:
        """The scorer (the name before 0.2)."""
        return self.scorer

    @property
    def retains_kv(self) -> bool:
        """Whether the plan retains KV entries (PrefixKV) instead of pruning the sequence."""
        return self.plan.kv is not None

    @property
    def kv_ratios(self) -> list[float] | None:
        """Per-layer eviction ratios of a KV-retention profile at this budget, or None (decided per call)."""
        kv = self.plan.kv
        return None if kv is None or kv.ratios is None else list(kv.ratios)

    # -- public API ------------------------------------------------------------------------------------
    @property
    def last_stats(self) -> CallStats | None:
        """Statistics of the most recent prefill with visual tokens on this thread (else on any), or None."""
        own = self.calls.last_stats
        if own is not None:
            return own
        return self.stats[-1] if self.stats else None

    def set_evidence(self, evidence: list | None) -> None:
        """Per-sample ``[N_b]`` evidence weights for the next calls on this thread (the ``oracle`` method)."""
        self._set_request("vtprune_evidence", evidence)

    def set_image_sizes(self, sizes: list[tuple[int, int]] | None) -> None:
        """Original ``(height, width)`` of every image of the next calls on this thread (debias padding map)."""
        self._set_request("vtprune_image_sizes", None if sizes is None else [tuple(int(v) for v in s) for s in sizes])

    def _set_request(self, key: str, value: Any) -> None:
        if value is None:
            self.calls.request.pop(key, None)
        else:
            self.calls.request[key] = value

    def call_state(self, outside: bool = False) -> dict[str, Any] | None:
        """Scratch space of the prefill running on this thread, for methods' own capture hooks.

        None while decoding, while an unpruned forward runs, or outside any forward: capture hooks then do
        nothing. With ``outside=True``, a capture made outside any forward (``generate()`` runs the vision
        tower before its first forward) goes to the thread's pending dict, adopted by the next call that
        starts on the thread.
        """
        frames = self.calls.frames
        if not frames:
            return self.calls.pending if outside else None
        call = frames[-1].call
        if call is None or call.decoding or call.abandoned:
            return None
        return call.method_state

    def add_hook(self, hook: torch.utils.hooks.RemovableHandle) -> None:
        """Adopt a hook registered elsewhere so that :meth:`remove` removes it too."""
        self._hooks.append(hook)

    def observe(self, observer: Callable[[StageRecord], None]) -> Callable[[], None]:
        """Call ``observer(record)`` at every stage of every prefill (scores, kept slots, counts); returns a
        function that stops it. Records hold the call's tensors: keep only what you need."""
        self.observers.append(observer)
        return lambda: self.observers.remove(observer) if observer in self.observers else None

    def remove(self) -> None:
        """Remove every hook and drop every call state; the model is the pristine model again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        guards.uninstall(self.model, self._guards)
        self._guards.clear()
        self.calls.clear()
        if getattr(self.model, "_vtprune_handle", None) is self:
            del self.model._vtprune_handle

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def __enter__(self) -> PruneHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __deepcopy__(self, memo: dict) -> PruneHandle:
        raise TypeError(DEEPCOPY_MESSAGE)

    def __getstate__(self) -> dict:
        raise TypeError(PICKLE_MESSAGE)

    def __repr__(self) -> str:
        stages = ", ".join(f"{s.layer}:{s.keep:g}" for s in self.stages)
        debias = getattr(self.scorer, "option", None) if isinstance(self.scorer, Debiased) else None
        extra = f", debias={debias!r}" if debias else ""
        if getattr(self.config, "parity", "default") == "release":
            extra += ", parity='release'"
        return f"PruneHandle(method={self.scorer.name!r}, stages=[{stages}]{extra}, active={self.active})"

    # -- registration -------------------------------------------------------------------------------------
    def _register(self) -> None:
        captures = self.scorer.captures(self.adapter, self.stages)  # may raise: before any hook exists
        model = self.model
        pre, post = EagerHook(self._model_pre_hook), EagerHook(self._model_post_hook)
        self._hooks.append(model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        self._hooks.append(model.register_forward_hook(post, with_kwargs=True, always_call=True))
        lm = self.adapter.language_model
        self._hooks.append(lm.register_forward_pre_hook(EagerHook(self._lm_pre_hook), with_kwargs=True))
        if self.config.logits == "input" and self.plan.kv is None:
            self._hooks.append(lm.register_forward_hook(EagerHook(self._lm_post_hook), with_kwargs=True))
        first, score_layers = self.plan.first_pruned_layer(), self.plan.score_layers(self.adapter.num_layers)
        for index, layer in enumerate(self.adapter.decoder_layers):
            if index in score_layers or (first is not None and index >= first):
                hook = layer.register_forward_pre_hook(EagerHook(LayerHook(self, index)), with_kwargs=True)
                self._hooks.append(hook)
        for capture in captures:
            hook = EagerHook(CaptureHook(self, capture))
            if capture.before:
                self._hooks.append(capture.module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._hooks.append(capture.module.register_forward_hook(hook, with_kwargs=True))
        self._guards = guards.install(self.model, self.calls, self.adapter)

    # -- whole-model hooks --------------------------------------------------------------------------
    def _model_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        depth = len(self.calls.frames)
        try:
            return self._open_frame(module, args, kwargs)
        except BaseException as error:  # an Exception reaches the always-called post-hook; anything else not
            if not isinstance(error, Exception):
                self.calls.unwind_to(depth)
            raise

    def _open_frame(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        frame = self.calls.enter()
        pending = self.calls.take_pending()
        if module.training:
            self._warn_training()
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            return
        cache = cache_of(kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            frame.call = self._continue(cache, kwargs)
            frame.restore = guards.adopt(self.adapter, frame.call, self.calls)  # undone as the frame closes
            total = self.calls.take_total(cache)
            fixed = decode.unseen_tokens(frame.call, kwargs, total) if frame.call is not None else None
            return None if fixed is None else (args, fixed)
        if cache is not None:  # an empty cache holds no conversation (a reset one may still be bound or marked)
            self.calls.unbind(cache)
            guards.unmark(cache)
        # Whether the prompt has visual tokens (and how many) is read at the LM pre-hook, in the prefill's one
        # transfer from the device; a call without any is abandoned there.
        frame.call = self._new_call(input_ids, self.adapter.visual_mask(input_ids), kwargs, pending)
        frame.call.cache_problem = guards.cache_problem(cache)
        if self.config.logits == "input" and self.plan.kv is None:  # the call's own copies: see _lm_post_hook
            frame.call.labels = outputs.own_labels(kwargs)
            return (args, {**kwargs, **frame.call.labels}) if frame.call.labels else None

    def _continue(self, cache: Any, kwargs: dict) -> CallState | None:
        """The call whose decode state ``cache`` holds (a decode step or a follow-up turn), or None."""
        if any(kwargs.get(k) is not None for k in PIXEL_KEYS):
            raise RuntimeError(
                "vtprune prunes visual tokens at prefill; this call adds images to a non-empty cache "
                "(a follow-up turn with new images). Start a new cache, or remove the handle for this call."
            )
        call = self.calls.lookup(cache)
        if call is None and guards.held_elsewhere(cache, self.calls):
            raise UserError(guards.PRUNED_CACHE_MESSAGE)
        if call is not None:
            call.decoding, call.decode_columns, call.step = True, None, {}
        return call

    def _new_call(self, input_ids: torch.Tensor, visual: torch.Tensor, kwargs: dict, pending: dict) -> CallState:
        inputs = {**kwargs, **self.calls.request}
        inputs.pop("cache", None)
        inputs.pop("past_key_values", None)
        return CallState(
            num_visual=visual.sum(dim=1),
            visual_counts=[],
            prompt_length=input_ids.shape[1],
            stats=CallStats(visual_tokens=[], timer=Timer(visual.device)),
            segments=LazySegments(lambda: self.adapter.segments(input_ids, inputs)),
            inputs=inputs,
            visual=visual,
            ordinal=visual_ordinals(visual),
            method_state=dict(pending),
        )

    def _model_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call = self.calls.current()  # a prefill's model state is read while its forward still holds the lock
        state = self.adapter.conversation_state() if call is not None and not call.decoding else None
        frame = self.calls.exit()
        call = frame.call if frame is not None else None
        if call is None:
            return
        if call.decoding:
            step = kwargs.get("input_ids", args[0] if args else None)
            call.decoded += step.shape[1] if step is not None else 1
            if call.kv_decode is not None and output is not None:
                kv.release_step(self.plan.kv, call)
            return
        self._finish_prefill(call, kwargs, output, state)

    def _finish_prefill(self, call: CallState, kwargs: dict, output: Any, state: dict | None) -> None:
        """Record the stats, keep the small decode state keyed by the cache (and ``state``, what the model kept of
        this prefill: :meth:`Adapter.conversation_state`), drop everything else."""
        stats = call.stats
        if stats.timer is not None:
            stats.timer.stop()
        ran = bool(call.views)
        cache = cache_of_output(output) or cache_of(kwargs) if output is not None else None
        if ran and cache is not None and self.plan.kv is not None:
            kv.evict(self.wiring, call, cache)
        # KV retention without a cache (use_cache=False) evicted nothing: no stats. A plan without stages
        # (method none) records its call, with every visual token kept, as the baseline of a comparison.
        pruned = bool(stats.stage_layers) or self.plan.kv is None
        if output is not None and call.views and pruned:
            outputs.attach_positions(output, _kept_positions(call))
            stats.defer_kept_indices(call.stage_ordinals)
            self.stats.append(stats)
            self.calls.last_stats = stats
            if self.record_indices >= 0 and len(self.stats) > self.record_indices:
                self.stats[-self.record_indices - 1].kept_indices = None
        if self.plan.kv is None:  # KV retention knows it in kv.evict
            call.cache_pruned = any(k < n for row in stats.kept for k, n in zip(row, stats.visual_tokens, strict=True))
        call.finish_prefill(self.plan.positions == "compact")
        if ran and cache is not None:
            call.model_state = state  # this prefill's (Qwen-VL: its rope_deltas)
            self.calls.bind(cache, call)
            if call.cache_pruned:  # only this wrapping may extend it (guards.PrunedCache)
                guards.mark_pruned(cache, self.calls)

    def _warn_training(self) -> None:
        if not self._warned_training:
            self._warned_training = True
            warnings.warn(
                "vtprune does not prune in training mode: this forward runs unpruned (labels would not match a "
                "pruned sequence). Call model.eval() for pruned inference.", stacklevel=3)

    # -- language-model hook ------------------------------------------------------------------------
    def _lm_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call = self.calls.current()
        if call is None:
            return None
        if call.decoding:
            return args, decode.lm_kwargs(call, kwargs)
        result = prefill.lm_input(self.wiring, call, args, kwargs)
        if not call.abandoned and self.plan.kv is None:
            outputs.check_labels(self.config.logits, call.inputs)
        return result

    def _lm_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Prefill with ``logits="input"``: the LM's last hidden state back in the input layout, before ``lm_head``."""
        call = self.calls.current()
        if call is None or call.decoding or not call.views or (len(call.views) == 1 and call.pre_llm_index is None):
            return None
        hidden = outputs.last_hidden(output)
        if hidden is None:
            return None
        positions = _kept_positions(call)
        if call.labels:  # a label after a pruned visual token has no row to predict it (NaN): ignored by the loss
            outputs.ignore_unpredicted(call.labels, positions, call.visual)
        return outputs.set_output_rows(output, outputs.to_input_layout(hidden, positions, call.visual))


class EagerHook:
    """A hook function that torch.compile never traces (a graph break: it runs eagerly, as written).

    The hooks slice tensors to data-dependent lengths and keep per-call state, which Dynamo cannot trace; a
    wrapped model still compiles, with graph breaks at the hooks. Copying or pickling a hook is refused: it
    belongs to its handle (see :meth:`PruneHandle.__deepcopy__`).
    """

    def __init__(self, fn: Callable) -> None:
        import torch._dynamo  # noqa: F401 - loaded at wrap time, never at ``import vtprune``

        self.fn, self.run = fn, torch.compiler.disable(fn)

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def __deepcopy__(self, memo: dict) -> EagerHook:
        raise TypeError(DEEPCOPY_MESSAGE)

    def __reduce__(self) -> Any:
        raise TypeError(PICKLE_MESSAGE)


class LayerHook:
    """The forward pre-hook of decoder layer ``index`` (an object, so a deep copy reaches the handle)."""

    def __init__(self, handle: PruneHandle, index: int) -> None:
        self.handle, self.index = handle, index

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        call = self.handle.calls.current()
        if call is None:
            return None
        wiring = self.handle.wiring
        if call.decoding:
            return decode.layer_kwargs(wiring, call, self.index, args, kwargs)
        if not call.views:
            return None
        if wiring.plan.kv is not None:
            return prefill.kv_priority(wiring, call, self.index, module, args, kwargs)
        return prefill.layer(wiring, call, self.index, module, args, kwargs)


class CaptureHook:
    """A scorer's :class:`~vtprune.methods.base.Capture`, fed the call's own state (nothing while decoding)."""

    def __init__(self, handle: PruneHandle, capture: Capture) -> None:
        self.handle, self.capture = handle, capture

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any = None) -> None:
        state = self.handle.call_state(outside=self.capture.outside_forward)
        if state is not None:
            self.capture.fn(state, module, args, kwargs, output)


def _kept_positions(call: CallState) -> torch.Tensor:
    """``[B, L_kept]``: the input position of each row of the call's pruned layout (-1 on padding rows)."""
    view = call.views[-1]
    return outputs.final_positions(view.index, view.valid, call.pre_llm_index)
