"""Measurements for ``vtprune bench --speed``: timed ``generate`` runs, KV-cache bytes, predictions, summaries.

Timing of one ``generate(max_new_tokens=N)`` call (``timed_generate``):

* **end to end**: wall time of the call (on CUDA synchronised before and after);
* **prefill**: from the call's start to the first logits-processor call, i.e. input preparation, the vision
  tower and the prefill forward that yields the first token;
* **decode per token**: the mean interval between consecutive logits-processor calls (``N - 1`` intervals),
  each one whole ``generate`` step (the forward over one token, argmax, stopping checks, input preparation);
  on CUDA the processor synchronises so each timestamp is the step's end (``generate`` already reads a flag
  from the device every step, so this adds no stall of its own);
* **time inside vtprune's hooks** per forward and phase (``vtprune.eval.speed.syncs.watch_hooks``): host time.

Percentiles are over repeats (one value per run); ``spread = p80 / p20`` says whether a difference means
anything. Pure helpers (``percentiles``, ``layer_lengths``, ``predict``) have hand-computed tests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vtprune.flops import LMShape, decode_flops, generate_flops, kv_cache_bytes, prefill_flops


def percentiles(values: Sequence[float], points: Sequence[int] = (20, 50, 80)) -> dict[int, float]:
    """``{p: value}`` of ``values`` at each percentile (linear interpolation; nan for no values)."""
    if not len(values):
        return {p: float("nan") for p in points}
    return {p: float(np.percentile(np.asarray(values, dtype=float), p)) for p in points}


def spread(values: Sequence[float]) -> float:
    """``p80 / p20`` of ``values`` (1.0 = no spread; nan when undefined)."""
    q = percentiles(values)
    return q[80] / q[20] if q[20] > 0 else float("nan")


@dataclass
class RunTiming:
    """One timed ``generate`` call (milliseconds; hook times in microseconds per forward of the phase)."""

    e2e_ms: float
    prefill_ms: float
    decode_ms: float
    steps: int
    hook_prefill_us: float = float("nan")
    hook_decode_us: float = float("nan")
    peak_bytes: int | None = None
    output: Any = field(default=None, repr=False)  # the generate output, when asked for (its cache)


@dataclass
class StepClock:
    """A ``LogitsProcessor`` that timestamps every ``generate`` step (synchronising on CUDA first)."""

    device: torch.device
    stamps: list[float] = field(default_factory=list)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs: dict, new_tokens: int, watch=None, track_memory: bool = False,
                   keep_output: bool = False) -> RunTiming:
    """Time one greedy ``generate`` of exactly ``new_tokens`` tokens (see the module docstring).

    ``watch``: a ``HookWatch`` whose counters are reset and read for the hook times. ``track_memory``: on
    CUDA, the call's peak allocated bytes above what was allocated before it. ``keep_output``: return the
    generate output (with its cache) in ``timing.output``; the caller should drop it soon.
    """
    from transformers import LogitsProcessorList

    device = inputs["input_ids"].device
    clock = StepClock(device)
    if watch is not None:
        watch.reset()
    if track_memory and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                                logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=keep_output)
    _sync(device)
    end = time.perf_counter()
    stamps = clock.stamps
    steps = max(0, len(stamps) - 1)
    timing = RunTiming(
        e2e_ms=(end - start) * 1e3,
        prefill_ms=(stamps[0] - start) * 1e3 if stamps else float("nan"),
        decode_ms=(stamps[-1] - stamps[0]) * 1e3 / steps if steps else float("nan"),
        steps=steps,
    )
    if watch is not None:
        timing.hook_prefill_us = watch.per_forward_us("prefill")
        timing.hook_decode_us = watch.per_forward_us("decode")
    if track_memory and device.type == "cuda":
        timing.peak_bytes = int(torch.cuda.max_memory_allocated(device) - before)
    if keep_output:
        timing.output = output
    return timing


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer of a transformers cache (``cache.layers[i].keys`` or legacy lists)."""
    if cache is None:
        return []
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


def kv_cache_measured(cache) -> tuple[int, list[int]]:
    """Bytes held by the cache's key and value tensors, and each layer's cached length (``[B, H, T, D]``)."""
    layers = cache_layers(cache)
    total = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
    return int(total), [int(k.shape[-2]) for k, _ in layers]


def generate_with_cache(model, inputs: dict, new_tokens: int):
    """Greedy ``generate`` returning its output (``.cache`` or ``.past_key_values`` holds the cache)."""
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)


def output_cache(output):
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


def layer_lengths(layers: int, prompt_length: int, text: Sequence[int], visual: Sequence[int],
                  stages: Sequence[tuple[int, Sequence[int]]]) -> list[int]:
    """Padded tokens each decoder layer computes on and caches at prefill, for a left-padded batch.

    ``prompt_length``: the padded input length; ``text[b]`` / ``visual[b]``: sample ``b``'s valid text and
    visual tokens; ``stages``: ``[(layer, kept visual tokens per sample), ...]``. Layers before the first
    stage see the padded prompt; from a stage on, the batch is repadded to its longest kept sample.
    """
    lengths, current = [], prompt_length
    stage_at = {layer: kept for layer, kept in stages}
    for layer in range(layers):
        if layer in stage_at:
            current = max(t + k for t, k in zip(text, stage_at[layer]))
        lengths.append(current)
    return lengths


def predict(shape: LMShape, base: Sequence[int], pruned: Sequence[int], new_tokens: int, batch: int,
            bytes_per_value: int) -> dict[str, float]:
    """FLOP-predicted speedups (prefill, decode, end to end) and KV bytes after ``generate``, from layer lengths."""
    decode_base = decode_flops(shape, base, new_tokens, batch)
    decode_pruned = decode_flops(shape, pruned, new_tokens, batch)
    return {
        "predicted_prefill": prefill_flops(shape, base, 1, batch) / prefill_flops(shape, pruned, 1, batch),
        "predicted_decode": decode_base / decode_pruned if decode_pruned else float("nan"),
        "predicted_e2e": generate_flops(shape, base, new_tokens, batch) / generate_flops(shape, pruned, new_tokens,
                                                                                         batch),
        "kv_bytes_predicted": kv_cache_bytes(shape, [n + new_tokens - 1 for n in pruned], bytes_per_value, batch),
        "prefill_gflops": prefill_flops(shape, pruned, 1, batch) / 1e9,
    }


def split_prediction(e2e_base_ms: float, prefill_base_ms: float, predicted_prefill: float,
                     predicted_decode: float) -> float:
    """End-to-end speedup if prefill and decode each sped up by their FLOP prediction (Amdahl on the split).

    The baseline's measured time splits into prefill and the rest (decode steps and ``generate``'s own
    work); each part is divided by its predicted speedup. Unlike the pure FLOP ratio this weighs decode by
    the time it takes, which on small or memory-bound steps is far more than its share of the FLOPs.
    """
    rest = e2e_base_ms - prefill_base_ms
    pruned = prefill_base_ms / predicted_prefill + rest / predicted_decode
    return e2e_base_ms / pruned if pruned > 0 else float("nan")


def stages_of(handle) -> list[tuple[int, list[int]]]:
    """``[(layer, kept visual tokens per sample), ...]`` of the handle's most recent prefill."""
    stats = handle.last_stats if handle is not None else None
    if stats is None:
        return []
    return [(layer, list(kept)) for layer, kept in zip(stats.stage_layers, stats.kept)]


def rss_bytes(field_name: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak since the last reset (``VmHWM``), in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field_name} not found in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset the process's peak resident set (``VmHWM``) to its current size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
