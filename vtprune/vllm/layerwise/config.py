"""Start-up of a model served with a layer-wise method: its plan, and the engine settings it needs or refuses.

vLLM seam (``vllm.model_executor.models.config.MODELS_CONFIG_MAP``, the per-architecture config hook vLLM calls
while it builds the engine config): :class:`LayerwiseConfig` runs for vtprune's architectures. For a layer-wise
method it installs the scheduler (:mod:`vtprune.vllm.layerwise.scheduler`), sets torch.compile and CUDA graphs
(:func:`graph_settings`: compiled, full CUDA graphs for decode steps),
turns async scheduling off, and refuses in one line what it cannot serve exactly: pipeline or context parallelism, speculative
decoding, KV connectors, micro-batching, a scheduler of the user's own. Chunked prefill and prefix caching work
(a pruned prompt's chunks are held until its last one; pruned requests skip prefix-cache reads).
"""

from __future__ import annotations

import logging
from typing import Any

from vtprune.vllm.layerwise.plan import LayerPlan, make_layer_plan, make_retention_scorer
from vtprune.vllm.settings import VllmPruning, is_retention

logger = logging.getLogger("vtprune.vllm")
SCHEDULER = "vtprune.vllm.layerwise.scheduler.PruningScheduler"
RETENTION_SCHEDULER = "vtprune.vllm.layerwise.retention_scheduler.RetentionScheduler"
#: the logits processor whose ``validate_params`` refuses ``prompt_logprobs`` (:mod:`vtprune.vllm.layerwise.logprobs`)
LOGPROBS_REFUSAL = "vtprune.vllm.layerwise.logprobs:PromptLogprobsRefusal"


def deepstack_layers(hf_config: Any) -> int:
    """How many first decoder layers receive Qwen3-VL's DeepStack features (0 for other families)."""
    vision = getattr(hf_config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or [])


def served_plan(model_config: Any) -> LayerPlan:
    """The :class:`LayerPlan` of a model config (``hf_config.vtprune`` settings, the text model's depth)."""
    pruning = VllmPruning.from_config(model_config.hf_config)
    text = model_config.hf_text_config
    return make_layer_plan(pruning.method, pruning.keep, int(text.num_hidden_layers), options=dict(pruning.options),
                           layer=pruning.layer, min_layer=max(1, deepstack_layers(model_config.hf_config)),
                           model_type=str(getattr(model_config.hf_config, "model_type", "model")),
                           hf_config=model_config.hf_config)


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(f"vtprune: {message}")


def check_engine(vllm_config: Any, method: str, own_scheduler: bool = True) -> None:
    """One-line refusals of the engine settings a layer-wise method cannot serve exactly (``own_scheduler``: the
    method runs vtprune's scheduler and KV groups)."""
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    _refuse(parallel.pipeline_parallel_size > 1, f"{method} prunes between decoder layers, which pipeline "
            "parallelism splits across ranks; serve it with pipeline_parallel_size=1 (tensor parallelism works).")
    _refuse(getattr(parallel, "decode_context_parallel_size", 1) > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1,
            f"{method} keeps each request's KV entries on one rank; turn context parallelism off.")
    _refuse(vllm_config.speculative_config is not None, f"{method} gives the runner one row per request, not the "
            "draft rows speculative decoding verifies; drop speculative_config.")
    _refuse(vllm_config.kv_transfer_config is not None, f"{method} stores pruned layers' KV compacted, which KV "
            "connectors would transfer as if it were whole; drop kv_transfer_config.")
    _refuse(bool(getattr(parallel, "enable_dbo", False)), f"{method} does not run with micro-batching (DBO); turn "
            "--enable-dbo off.")
    _refuse(scheduler.async_scheduling is True, f"{method} schedules synchronously (the pruned KV groups are sized "
            "per step); drop async_scheduling=True.")
    if not own_scheduler:
        return
    custom = scheduler.scheduler_cls
    _refuse(custom not in (None, SCHEDULER) and not (isinstance(custom, str) and custom.startswith("vllm.")),
            f"{method} needs vtprune's scheduler; drop scheduler_cls={custom!r}.")
    _refuse(bool(getattr(scheduler, "disable_hybrid_kv_cache_manager", False)), f"{method} keeps pruned layers in KV "
            "cache groups of their own; drop disable_hybrid_kv_cache_manager.")


def served_retention(model_config: Any) -> Any:
    """PrefixKV's scorer for a model config (``hf_config.vtprune`` settings), checked."""
    pruning = VllmPruning.from_config(model_config.hf_config)
    return make_retention_scorer(pruning.method, dict(pruning.options), model_config.hf_config)


def _retention_settings(vllm_config: Any, method: str) -> None:
    """PrefixKV: the settings the layer-wise methods refuse; vtprune's retention scheduler; prefix caching off (each
    layer's entries are rewritten after the prefill, so cached blocks would not hold the prompt's KV)."""
    check_engine(vllm_config, method, own_scheduler=False)
    if isinstance(getattr(vllm_config, "additional_config", None), dict):  # hashed into vLLM's compile-cache key (hf_overrides is not)
        vllm_config.additional_config["vtprune"] = "prefixkv: retention ops in the language model"
    custom = vllm_config.scheduler_config.scheduler_cls
    _refuse(custom not in (None, RETENTION_SCHEDULER) and not (isinstance(custom, str) and custom.startswith("vllm.")),
            f"{method} needs vtprune's scheduler (a recompute after a preemption ends a step at its prompt's end); "
            f"drop scheduler_cls={custom!r}.")
    vllm_config.scheduler_config.scheduler_cls = RETENTION_SCHEDULER
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # a GPU's KV cache is sized from a profile run that holds no prompt
        logger.warning("vtprune: %s holds each prefilling prompt's keys and values of every layer until its prefill "
                       "ends, up to %.2f GiB per rank, outside vLLM's memory profile; if the engine runs out of "
                       "memory, lower gpu_memory_utilization by that much.", method, held_entries_bytes(vllm_config) / 2**30)
    if vllm_config.cache_config.enable_prefix_caching:
        logger.warning("vtprune: %s rewrites each layer's KV entries after the prefill; prefix caching is turned off.",
                       method)
        vllm_config.cache_config.enable_prefix_caching = False


def held_entries_bytes(vllm_config: Any) -> int:
    """Bytes PrefixKV's prefills hold at most per rank (:mod:`vtprune.vllm.layerwise.retention` keeps each prefilling
    request's keys and values of every layer until its prefill ends): a step's ``max_num_batched_tokens``, plus one
    partial prompt of ``max_model_len`` from earlier chunks when chunked prefill is on, x layers x 2 x KV heads of
    the rank x head size x the model's bytes per value."""
    model, parallel, scheduler = vllm_config.model_config, vllm_config.parallel_config, vllm_config.scheduler_config
    tokens = scheduler.max_num_batched_tokens + (model.max_model_len if scheduler.enable_chunked_prefill else 0)
    per_token = (model.get_num_layers(parallel) * 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
                 * model.dtype.itemsize)
    return int(tokens * per_token)


def refuse_prompt_logprobs(model_config: Any) -> None:
    """Add :data:`LOGPROBS_REFUSAL` to the model's logits processors (once): the front end then refuses
    ``prompt_logprobs`` of every request in one line (pruned positions have no exact prompt log-probability)."""
    processors = list(getattr(model_config, "logits_processors", None) or [])
    if LOGPROBS_REFUSAL not in processors:
        model_config.logits_processors = [*processors, LOGPROBS_REFUSAL]


class LayerwiseConfig:
    """vLLM's per-architecture config hook for vtprune's architectures (a ``VerifyAndUpdateConfig``)."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        pruning = VllmPruning.from_config(model_config.hf_config)
        if not pruning.layer_wise:
            return
        _refuse(bool(getattr(vllm_config, "use_v2_model_runner", False)), f"{pruning.method} runs on vLLM's V1 model "
                "runner (its input batch, block tables and metadata builders); set VLLM_USE_V2_MODEL_RUNNER=0 "
                "(`vtprune serve` sets it).")
        if is_retention(pruning.method):
            served_retention(model_config)  # refuse a bad option now, in the caller's process
            _retention_settings(vllm_config, pruning.method)
        else:
            served_plan(model_config)  # refuse a bad method, layer or option now, in the caller's process
            check_engine(vllm_config, pruning.method)
            vllm_config.scheduler_config.scheduler_cls = SCHEDULER
            refuse_prompt_logprobs(model_config)
            if isinstance(getattr(vllm_config, "additional_config", None), dict):  # hashed into the compile-cache key
                vllm_config.additional_config["vtprune"] = (
                    f"{pruning.method} keep={pruning.keep} layer={pruning.layer} options={pruning.options}: layer-wise "
                    "ops in the language model")
        vllm_config.scheduler_config.async_scheduling = False
        graph_settings(vllm_config, pruning.method, compiled=True)

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return None


def graph_settings(vllm_config: Any, method: str, compiled: bool, modes: tuple | None = None,
                   static_graphs: bool | None = None) -> None:
    """torch.compile and CUDA graphs for a layer-wise method. ``compiled``: the method's hooks only call vtprune's
    ops (PrefixKV's, :mod:`vtprune.vllm.layerwise.ops`; the compacting methods', whose compaction returns a row
    count the graph learns at run time, :mod:`vtprune.vllm.layerwise.layer_ops`), so vLLM's compile mode stays; a
    method whose hooks did more would run uncompiled. Decode steps need no hook (each group's metadata builder
    shifts them, :mod:`vtprune.vllm.layerwise.decode`), so where the platform has CUDA graphs they keep full graphs
    for uniform decode batches (``FULL_DECODE_ONLY``); steps with a prompt run without graphs (piecewise graphs
    would replay the ops' captured kernels without their Python). One warning line for each setting changed. ``modes`` (vLLM's ``CompilationMode`` and
    ``CUDAGraphMode``) and ``static_graphs`` (whether the platform has CUDA graphs) default to vLLM's own."""
    if vllm_config.model_config.enforce_eager:
        return
    if modes is None:
        from vllm.config.compilation import CompilationMode, CUDAGraphMode
        from vllm.platforms import current_platform

        modes, static_graphs = (CompilationMode, CUDAGraphMode), current_platform.support_static_graph_mode()
    CompilationMode, CUDAGraphMode = modes  # noqa: N806 - vLLM's enum names
    compilation = vllm_config.compilation_config
    if not compiled and compilation.mode != CompilationMode.NONE:
        logger.warning("vtprune: %s runs Python between decoder layers that torch.compile graphs cannot follow: its "
                       "language model runs uncompiled (compilation mode NONE).", method)
        compilation.mode = CompilationMode.NONE
    mode = compilation.cudagraph_mode
    if static_graphs and mode != CUDAGraphMode.NONE and (
            mode is None or mode.has_piecewise_cudagraphs()):
        logger.warning("vtprune: %s keeps CUDA graphs for uniform decode steps only (cudagraph_mode "
                       "FULL_DECODE_ONLY): steps with a prompt run Python between layers, which piecewise graphs "
                       "would skip.", method)
        compilation.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY


def register_config_hooks(architectures: Any) -> None:
    """Add :class:`LayerwiseConfig` to vLLM's per-architecture config hooks for ``architectures``."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for name in architectures:
        MODELS_CONFIG_MAP.setdefault(name, LayerwiseConfig)
