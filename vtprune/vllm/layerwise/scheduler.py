"""The scheduler of a served layer-wise model: each request's pruned counts, known when it arrives.

vLLM seam (``scheduler_cls``, "not public" in vLLM's words): :class:`PruningScheduler` is vLLM's ``Scheduler`` plus
:class:`PruningSchedulerMixin`, which, for every request with visual tokens, computes the tokens each layer region
misses from its placeholders and keep (:func:`vtprune.vllm.layerwise.requests.pruned_table`), hands that table to the
pruned groups' KV managers (:class:`vtprune.vllm.layerwise.kv.PrunedManager`) and marks the request to skip prefix-cache
reads: its pruned layers' KV depends on the question, and its prompt must be scored whole. It also writes the request's
keep into the request's own sampling parameters (:func:`vtprune.vllm.layerwise.requests.carry_keep`): vLLM strips a
prefix-cached item's data before the workers see it, and the workers must prune exactly as planned here.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from vtprune.vllm.layerwise import kv
from vtprune.vllm.layerwise.config import served_plan
from vtprune.vllm.layerwise.requests import carry_keep, pruned_table, request_keep
from vtprune.vllm.settings import VllmPruning


class PruningSchedulerMixin:
    """Pruned counts per request for the KV managers; no prefix-cache reads for pruned requests."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.vllm_config.model_config
        self.vtprune_keep = VllmPruning.from_config(config.hf_config).keep
        self.vtprune_plan = served_plan(config)
        #: request id -> tokens missing in each layer region (region 0 first), for pruned requests only
        self.vtprune_pruned: dict[str, tuple[int, ...]] = {}
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for manager in managers:
            if isinstance(manager, kv.PrunedManager):
                manager.pruned = self.vtprune_pruned

    def add_request(self, request: Any) -> None:
        if request.request_id not in self.requests and request.mm_features:
            keep = request_keep(request.mm_features, self.vtprune_keep)
            carry_keep(request, keep)  # the workers may get the items stripped (prefix cache): the keep goes along
            table = pruned_table(self.vtprune_plan, request.mm_features, self.vtprune_keep, keep)
            if any(table):
                self.vtprune_pruned[request.request_id] = table
                request.skip_reading_prefix_cache = True
        super().add_request(request)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = super()._free_request(request, *args, **kwargs)
        self.vtprune_pruned.pop(request.request_id, None)
        return out


class PruningScheduler(PruningSchedulerMixin, Scheduler):
    """vLLM's scheduler for a model served with a layer-wise method."""
