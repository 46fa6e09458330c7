"""The scheduler of a model served with PrefixKV: each layer's evicted blocks go back to the pool, and a recomputed
request's prompt ends a step of its own.

vLLM seams (``scheduler_cls``; ``Scheduler.update_from_output``; ``Scheduler._reserve_prefill_lookahead``, the last
cap vLLM puts on a request's scheduled tokens, for running and for waiting requests alike):

* **Freeing.** Every decoder layer is a KV cache group of its own (:class:`vtprune.vllm.layerwise.kv.RetainedManager`).
  When a prefill ends, rank 0's worker reports the entries each layer evicted in that step's output
  (:data:`REPORT`, written by :class:`vtprune.vllm.layerwise.retention.RetentionRuntime`, which cuts its own block
  table rows in the same step); :meth:`RetentionScheduler.update_from_output` hands the counts to the layers'
  managers, which return the blocks past each layer's kept entries to vLLM's shared pool before the next step is
  scheduled. Later tokens are allocated after the kept entries.
* **Recomputing.** After a preemption vLLM recomputes a request's prompt and its generated tokens, in one step when
  the budget allows. PrefixKV's layers only know their kept entries once the prompt's last row ran through every
  layer, so the generated rows of that step would attend to every prompt entry, where the original decode read each
  layer's kept ones. :class:`RetentionScheduler` ends such a step at the prompt's end
  (:func:`vtprune.vllm.layerwise.retention.prompt_chunk`): the next step runs the generated rows as a multi-token
  decode over each layer's kept entries, as they were computed the first time. A preempted request's blocks are
  freed whole and its counts forgotten, so its recompute is allocated the whole prompt again.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from vtprune.vllm.layerwise import kv
from vtprune.vllm.layerwise.retention import REPORT, prompt_chunk

SEAM = "_reserve_prefill_lookahead"


class RetentionScheduler(Scheduler):
    """vLLM's scheduler for a model served with PrefixKV (per-layer blocks freed after each prefill; a recompute
    never runs past its prompt in one step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not callable(getattr(Scheduler, SEAM, None)):
            raise RuntimeError(f"vtprune: this vLLM's Scheduler has no {SEAM}, where PrefixKV splits a recompute at "
                               "its prompt's end; use the vLLM version vtprune names (docs/serving.md).")
        super().__init__(*args, **kwargs)
        #: request id -> entries each layer evicted (layer 0 first), from the prefill's step until the request is freed
        self.vtprune_evicted: dict[str, tuple[int, ...]] = {}
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self.vtprune_layers = [m for m in managers if isinstance(m, kv.RetainedManager)]
        for manager in self.vtprune_layers:
            manager.evicted = self.vtprune_evicted
        #: blocks returned to the pool and prefills reported so far (read by tests and the serving benchmark)
        self.vtprune_released, self.vtprune_reported = 0, 0

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        count = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        return prompt_chunk(num_computed_tokens, count, request.num_prompt_tokens)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        reported = getattr(model_runner_output, REPORT, None)
        if reported:
            self.release(reported)
        return super().update_from_output(scheduler_output, model_runner_output)

    def release(self, reported: dict[str, tuple[int, ...]]) -> None:
        """Each reported request's counts to the layers' managers, which free the blocks past its kept entries."""
        for request_id, evicted in reported.items():
            request = self.requests.get(request_id)
            if request is None:  # aborted meanwhile: its blocks are already back
                continue
            if len(evicted) != len(self.vtprune_layers):
                raise RuntimeError(f"vtprune: prefixkv reported {len(evicted)} layers' counts for "
                                   f"{len(self.vtprune_layers)} KV cache groups (untested vLLM version?).")
            self.vtprune_evicted[request_id] = tuple(int(n) for n in evicted)
            self.vtprune_reported += 1
            for manager in self.vtprune_layers:
                self.vtprune_released += manager.release(request_id, request.num_computed_tokens)
