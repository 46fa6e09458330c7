"""The scheduler of a model served with PrefixKV: a recomputed request's prompt ends a step of its own.

vLLM seam (``scheduler_cls``; ``Scheduler._reserve_prefill_lookahead``, the last cap vLLM puts on a request's
scheduled tokens, for running and for waiting requests alike). After a preemption vLLM recomputes a request's
prompt and its generated tokens, in one step when the budget allows. PrefixKV's layers only know their kept
entries once the prompt's last row ran through every layer, so the generated rows of that step would attend to
every prompt entry, where the original decode read each layer's kept ones. :class:`RetentionScheduler` ends such a
step at the prompt's end (:func:`vtprune.vllm.layerwise.retention.prompt_chunk`): the next step runs the generated
rows as a multi-token decode over each layer's kept entries, as they were computed the first time.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from vtprune.vllm.layerwise.retention import prompt_chunk

SEAM = "_reserve_prefill_lookahead"


class RetentionScheduler(Scheduler):
    """vLLM's scheduler for a model served with PrefixKV (a recompute never runs past its prompt in one step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not callable(getattr(Scheduler, SEAM, None)):
            raise RuntimeError(f"vtprune: this vLLM's Scheduler has no {SEAM}, where PrefixKV splits a recompute at "
                               "its prompt's end; use the vLLM version vtprune names (docs/serving.md).")
        super().__init__(*args, **kwargs)

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        count = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        return prompt_chunk(num_computed_tokens, count, request.num_prompt_tokens)
