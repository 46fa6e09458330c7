"""``vtprune bench --speed``: what a user waits for: ``generate()`` end to end, prefill, decode, memory, batches.

For each geometry x batch x method x keep one CSV row (``COLUMNS``), baseline (``none``) rows included, on
random-weight proxies (``vtprune.eval.speed.proxy``): the real transformers code path with a realistic
language model (``--speed-lm proxy``: ``--speed-hidden`` x ``--speed-layers``; ``--speed-lm 7b``: the
LLaVA-1.5-7B and Qwen2.5-VL-7B language models) and a tiny vision tower. Per block (geometry x batch):

1. one warm-up ``generate`` per config (``min(N, 8)`` new tokens) under ``count_syncs``: host syncs inside
   vtprune's hooks per prefill and per decode step, and the whole call's syncs minus the unwrapped model's;
2. ``--repeats`` timed ``generate`` runs of ``--speed-new-tokens`` tokens per config, round robin over
   the configs (so a slow spell of the shared machine hits them all): end to end, prefill, decode per
   token, host time inside the hooks (``vtprune.eval.speed.measure``); the first run's cache gives the
   KV-cache bytes (summed over the cache tensors, read after the timer stops) and, on CUDA, the peak memory;
3. on CPU, the peak-RSS delta of each call, measured afterwards in one fresh subprocess
   (``vtprune.eval.speed.memory``) with a fixed malloc mmap threshold, so freed tensors leave the RSS.

Predicted speedups are FLOP ratios (``vtprune.flops``) on the padded per-layer lengths the engine computes
on (``speed_measure.layer_lengths``), vision tower excluded. Hook overhead per decode step is the method at
keep 1.0 minus the unwrapped model (decode step p50, µs and % of the step); ``hook_time_*`` is the host
time measured inside the hooks themselves. Rows whose p80/p20 exceeds ``--speed-max-spread`` are flagged.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vtprune.cli.checks import int_range, number_range

COLUMNS = [
    "geometry", "geometry_key", "family", "lm", "batch", "visual_tokens", "visual_per_sample", "text_tokens",
    "prompt_tokens", "method", "keep", "layer", "kept_per_stage", "new_tokens", "repeats", "status",
    "e2e_base_ms_p50", "e2e_ms_p20", "e2e_ms_p50", "e2e_ms_p80", "e2e_spread", "spread_ok",
    "prefill_base_ms_p50", "prefill_ms_p20", "prefill_ms_p50", "prefill_ms_p80",
    "decode_base_ms_p50", "decode_ms_p20", "decode_ms_p50", "decode_ms_p80",
    "speedup_prefill", "predicted_prefill", "efficiency_prefill",
    "speedup_decode", "predicted_decode", "efficiency_decode",
    "speedup_e2e", "predicted_e2e", "efficiency_e2e",
    "throughput_base", "throughput", "prefill_gflops",
    "hook_overhead_us", "hook_overhead_pct", "hook_time_prefill_us", "hook_time_decode_us", "hook_time_decode_pct",
    "syncs_prefill_hooks", "syncs_decode_hooks", "syncs_prefill_delta", "syncs_decode_delta", "sync_ops_hooks",
    "kv_bytes_base", "kv_bytes", "kv_bytes_predicted", "kv_error_pct",
    "peak_mem_base_mb", "peak_mem_mb", "mem_method",
    "lm_hidden", "lm_layers", "lm_heads", "lm_kv_heads", "lm_intermediate", "lm_vocab",
    "device", "threads", "dtype", "attn_implementation", "torch", "transformers", "vtprune", "git_sha", "git_dirty",
    "weights_sha", "date",
]  # fmt: skip
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def __getattr__(name: str) -> Any:
    """``DTYPES`` (``{name: torch.dtype}``) is built on first use: ``vtprune bench --help`` imports no torch."""
    if name == "DTYPES":
        import torch

        return {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
WARMUP_TOKENS = 8


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--speed-*`` options added by this benchmark (``bench`` registers ``--speed``, ``--speed-hidden``,
    ``--speed-layers``, ``--speed-tokens`` and ``--layer`` itself)."""
    group = parser.add_argument_group("speed (--speed; also uses --methods, --keep, --repeats, --attn, --dtype, "
                                      "--device, --threads, --out, --speed-hidden/-layers/-tokens, --layer)")
    group.add_argument("--speed-lm", default="proxy", choices=("proxy", "7b"),
                       help="language model: proxy (--speed-hidden x --speed-layers) or the 7B models' geometry")
    group.add_argument("--speed-batches", default="1,8", help="batch sizes (samples are ragged beyond 1)")
    group.add_argument("--speed-new-tokens", type=int_range(2, 1 << 16), default=32,
                       help="tokens generate() produces, 2 or more (e.g. 32, 256)")
    group.add_argument("--speed-memory", default="auto", choices=("auto", "off"),
                       help="peak memory: auto (CUDA allocator / CPU RSS in a fresh subprocess) or off")
    group.add_argument("--speed-syncs", default="on", choices=("on", "off"), help="count host syncs in the warm-up")
    group.add_argument("--speed-max-spread", type=number_range(1.0), default=1.25,
                       help="flag rows whose p80/p20 (baseline or pruned, end to end) exceeds this, >= 1")
    group.add_argument("--speed-budget-s", type=number_range(0.0), default=0.0,
                       help="start no new geometry x batch block after this many seconds (0: no limit)")


def _csv_numbers(text: str, kind, flag: str, low: float, high: float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{flag} {text!r}: give comma-separated numbers in [{low:g}, {high:g}], e.g. {flag} "
                         f"{'1,8' if kind is int else '1,0.5,0.25'}.")
    return values


def plan_from(args: argparse.Namespace) -> dict:
    """Validated settings of a speed run (``ValueError`` naming the option and the fix)."""
    import torch
    from vtprune.eval.speed.proxy import lm_geometry, parse_geometries

    if args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype {args.dtype!r}: use one of {', '.join(DTYPE_NAMES)}.")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no GPU; use --device cpu.")
    if args.repeats < 1 or args.speed_new_tokens < 2:
        raise ValueError(f"--repeats {args.repeats} / --speed-new-tokens {args.speed_new_tokens}: need at least 1 "
                         "repeat (5+ for meaningful p20/p80) and 2 new tokens (one decode step).")
    from vtprune.cli.checks import known_methods

    known_methods([m for m in args.methods.split(",") if m])
    methods = [m for m in args.methods.split(",") if m and m not in ("none", "oracle")]
    if "oracle" in args.methods.split(","):
        print("[speed] skipping 'oracle': it needs evidence masks, which the speed proxies do not have")
    keeps = sorted(set(_csv_numbers(args.keep, float, "--keep", 1e-6, 1.0)) | {1.0}, reverse=True)
    geometries = parse_geometries(args.speed_tokens)
    for family in {g.family for g in geometries}:
        lm_geometry(family, args.speed_lm, args.speed_hidden, args.speed_layers)  # validates
    if args.repeats < 5:
        print(f"[speed] --repeats {args.repeats}: p20/p80 over fewer than 5 runs interpolate 1-4 values; use 5+")
    return {"device": device, "dtype": getattr(torch, args.dtype), "methods": methods, "keeps": keeps,
            "geometries": geometries, "batches": _csv_numbers(args.speed_batches, int, "--speed-batches", 1, 1024),
            "new_tokens": args.speed_new_tokens}


def run_speed(args: argparse.Namespace) -> Path:
    """The whole speed benchmark; returns the CSV path (also writes ``speed.md`` and PNG plots)."""
    import torch
    from vtprune.eval.speed.proxy import build_model, lm_geometry
    from vtprune.eval.speed.report import write_report

    from vtprune.cli.checks import check_output_dir
    from vtprune.cli.outputs import check_new_results

    _fill_defaults(args)
    plan = plan_from(args)
    out = check_new_results(check_output_dir(args.out), ("speed.csv", "speed.md"), getattr(args, "force", False))
    if args.threads:
        torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "speed.csv"
    started, rows, skipped, memory_jobs = time.time(), [], [], []
    blocks = [(g, b) for g in plan["geometries"] for b in plan["batches"]]
    configs = [("none", 1.0)] + [(m, k) for m in plan["methods"] for k in plan["keeps"]]
    progress = tqdm(total=len(blocks) * len(configs) * (args.repeats + 1), desc="speed", unit="run")
    for family in dict.fromkeys(g.family for g in plan["geometries"]):
        family_blocks = [(g, b) for g, b in blocks if g.family == family]
        lm = lm_geometry(family, args.speed_lm, args.speed_hidden, args.speed_layers)
        model = build_model(family, lm, args.attn, plan["dtype"], plan["device"])
        env = _conditions(model, args)
        for geometry, batch in family_blocks:
            if args.speed_budget_s and time.time() - started > args.speed_budget_s:
                skipped.append(f"{geometry.key} x batch {batch}")
                progress.update(len(configs) * (args.repeats + 1))
                continue
            progress.set_description(f"speed {geometry.key} b{batch}")
            block = measure_block(model, lm, geometry, batch, configs, args, plan, progress)
            rows += [{**r, **env} for r in block]
            memory_jobs.append({"geometry": geometry.key, "batch": batch})
            write_csv(path, rows)
        del model
        gc.collect()
        if plan["device"].startswith("cuda"):
            torch.cuda.empty_cache()
    progress.close()
    if skipped:
        print(f"[speed] time budget {args.speed_budget_s:g} s spent; skipped: {', '.join(skipped)}")
    if args.speed_memory == "auto" and not plan["device"].startswith("cuda") and memory_jobs:
        _merge_cpu_memory(rows, memory_jobs, configs, args, plan)
    write_csv(path, rows)
    if rows:
        write_report(path, out, max_spread=args.speed_max_spread)
        print()
        print((out / "speed.md").read_text())
    print(f"[bench] wrote {path} ({len(rows)} rows), {out / 'speed.md'} and plots")
    return path


def _fill_defaults(args: argparse.Namespace) -> None:
    """Give ``args`` the defaults of any ``--speed-*`` option its parser did not register."""
    parser = argparse.ArgumentParser(add_help=False)
    add_speed_arguments(parser)
    for name, value in vars(parser.parse_args([])).items():
        if not hasattr(args, name):
            setattr(args, name, value)


def _conditions(model, args: argparse.Namespace) -> dict:
    from vtprune.eval.accuracy.report import conditions

    env = conditions(model, args)
    env.pop("batch_size", None)
    return env


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _wrap(model, method: str, keep: float, layer: int | None):
    import vtprune

    if method == "none":
        return nullcontext(None)
    return vtprune.apply(model, method, keep=keep, **({"layer": layer} if layer is not None else {}))


def measure_block(model, lm, geometry, batch: int, configs: list[tuple[str, float]], args, plan, progress) -> list:
    """Rows of one geometry x batch: warm-up with sync counts, then round-robin timed repeats per config."""
    from vtprune.eval.speed.proxy import batch_inputs, text_tokens
    from vtprune.eval.speed.rows import summarise_block

    inputs = batch_inputs(model, geometry, batch, lm, plan["device"])
    warm, timings = {}, {cfg: [] for cfg in configs}
    for cfg in configs:
        progress.set_postfix_str(f"warm-up {cfg[0]}@{cfg[1]:g}")
        warm[cfg] = _warm_up(model, inputs, cfg, args, min(plan["new_tokens"], WARMUP_TOKENS))
        progress.update(1)
    for repeat in range(args.repeats):
        for cfg in configs:
            progress.set_postfix_str(f"repeat {repeat + 1}/{args.repeats} {cfg[0]}@{cfg[1]:g}")
            timings[cfg].append(_timed(model, inputs, cfg, args, plan, first=repeat == 0, record=warm[cfg]))
            progress.update(1)
    context = {"geometry": geometry, "batch": batch, "lm": lm, "lm_preset": args.speed_lm,
               "text": text_tokens(inputs, model), "prompt": int(inputs["input_ids"].shape[1]),
               "new_tokens": plan["new_tokens"], "repeats": args.repeats, "layer": args.layer,
               "bytes_per_value": next(model.parameters()).element_size(), "max_spread": args.speed_max_spread,
               "shape_config": model.config, "mem_method": "cuda max_memory_allocated delta"
               if plan["device"].startswith("cuda") else ("cpu peak RSS delta, fresh subprocess"
                                                         if args.speed_memory == "auto" else "off")}
    return summarise_block(context, configs, warm, timings)


def _warm_up(model, inputs: dict, cfg: tuple[str, float], args, tokens: int) -> dict:
    """One untimed ``generate`` per config; counts syncs (inside hooks / whole call, per phase)."""
    from vtprune.eval.speed.measure import generate_with_cache, stages_of
    from vtprune.eval.speed.syncs import count_syncs, watch_hooks

    record: dict = {"status": "ok"}
    try:
        with ExitStack() as stack:
            handle = stack.enter_context(_wrap(model, cfg[0], cfg[1], args.layer))
            watch = stack.enter_context(watch_hooks(handle if handle is not None else model))
            group = lambda: f"{watch.phase()}:{'hook' if watch.inside() else 'other'}"  # noqa: E731
            syncs = stack.enter_context(count_syncs(group=group)) if args.speed_syncs == "on" else None
            generate_with_cache(model, inputs, tokens)
            record["stages"] = stages_of(handle)
            record["stage_keeps"] = [(s.layer, s.keep) for s in handle.stages] if handle is not None else []
        if syncs is not None:
            steps = max(1, watch.forwards["decode"])
            record["syncs"] = {
                "prefill_hooks": syncs.in_group("prefill:hook"),
                "decode_hooks": syncs.in_group("decode:hook") / steps,
                "prefill_all": syncs.in_group("prefill:hook") + syncs.in_group("prefill:other"),
                "decode_all": (syncs.in_group("decode:hook") + syncs.in_group("decode:other")) / steps,
                "ops_hooks": {k: v for g in ("prefill:hook", "decode:hook")
                              for k, v in syncs.by_group.get(g, {}).items()},
            }
    except (RuntimeError, ValueError) as error:  # out of memory, unsupported config: report, go on
        record = {"status": _status(error)}
        _free(inputs)
    return record


def _timed(model, inputs: dict, cfg: tuple[str, float], args, plan, first: bool, record: dict):
    """One timed run; the first also measures KV-cache bytes (and CUDA peak memory)."""
    from vtprune.eval.speed.measure import (
        kv_cache_measured,
        output_cache,
        timed_generate,
    )
    from vtprune.eval.speed.syncs import watch_hooks

    if record.get("status") != "ok":
        return None
    try:
        with _wrap(model, cfg[0], cfg[1], args.layer) as handle:
            with watch_hooks(handle) if handle is not None else nullcontext(None) as watch:
                cuda_memory = first and args.speed_memory == "auto" and plan["device"].startswith("cuda")
                timing = timed_generate(model, inputs, plan["new_tokens"], watch, track_memory=cuda_memory,
                                        keep_output=first)
            if first:
                record["kv_bytes"], record["kv_lengths"] = kv_cache_measured(output_cache(timing.output))
                timing.output = None
        return timing
    except (RuntimeError, ValueError) as error:
        record["status"] = _status(error)
        _free(inputs)
        return None


def _status(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    kind = "oom" if "out of memory" in text.lower() else "error"
    return f"{kind}: {text[:120]}"


def _free(inputs: dict) -> None:
    import torch

    gc.collect()
    if inputs["input_ids"].device.type == "cuda":
        torch.cuda.empty_cache()


def _merge_cpu_memory(rows: list[dict], jobs: list[dict], configs, args, plan) -> None:
    """Peak-RSS deltas from one fresh subprocess (``vtprune.eval.speed.memory``), merged into ``rows``."""
    spec = {"jobs": jobs, "configs": configs, "lm": args.speed_lm, "hidden": args.speed_hidden,
            "layers": args.speed_layers, "attn": args.attn, "dtype": args.dtype, "threads": args.threads,
            "new_tokens": plan["new_tokens"], "layer": args.layer}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    print(f"[speed] peak memory: {len(jobs) * len(configs)} calls in a fresh subprocess")
    try:
        done = subprocess.run([sys.executable, "-m", "vtprune.eval.speed.memory"], input=json.dumps(spec), env=env,
                              capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        print("[speed] the memory subprocess timed out; peak_mem columns left empty")
        return
    if done.returncode:
        print(f"[speed] the memory subprocess failed; peak_mem columns left empty:\n{done.stderr[-2000:]}")
        return
    peaks = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            peaks[(r["geometry"], r["batch"], r["method"], r["keep"])] = r["peak_bytes"] / 2**20
    for row in rows:
        key = (row["geometry_key"], row["batch"])
        row["peak_mem_mb"] = _round(peaks.get((*key, row["method"], row["keep"])))
        row["peak_mem_base_mb"] = _round(peaks.get((*key, "none", 1.0)))


def _round(value: float | None) -> float | str:
    return "" if value is None else round(value, 1)
