"""One CSV row per config of a speed block: timings summarised, predictions, overhead, syncs, KV bytes.

Input: the warm-up records and the timed runs of ``vtprune.eval.speed.bench.measure_block``. Speedups are
ratios of p50s (baseline / config); efficiencies are measured / FLOP-predicted speedups.
"""

from __future__ import annotations

import math

from vtprune.eval.speed.measure import layer_lengths, percentiles, predict, spread

from vtprune.flops import LMShape


def _r(value: float, digits: int = 3) -> float | str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else round(float(value), digits)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _stat(runs: list, name: str) -> dict[int, float]:
    return percentiles([getattr(t, name) for t in runs if t is not None and not math.isnan(getattr(t, name))])


def summarise_block(context: dict, configs: list[tuple[str, float]], warm: dict, timings: dict) -> list[dict]:
    """Rows (``bench_speed.COLUMNS`` minus the conditions) for every config of one geometry x batch block."""
    geometry, batch, lm = context["geometry"], context["batch"], context["lm"]
    visual, text, new_tokens = geometry.visual_tokens(batch), context["text"], context["new_tokens"]
    shape = LMShape.from_config(context["shape_config"])
    base_lengths = layer_lengths(shape.layers, context["prompt"], text, visual, [])
    base_runs = timings.get(("none", 1.0), [])
    base = {name: _stat(base_runs, name) for name in ("e2e_ms", "prefill_ms", "decode_ms")}
    base_record = warm.get(("none", 1.0), {})
    base_syncs = base_record.get("syncs", {})
    rows = []
    for cfg in configs:
        method, keep = cfg
        record, runs = warm.get(cfg, {}), [t for t in timings.get(cfg, []) if t is not None]
        stats = {name: _stat(runs, name) for name in ("e2e_ms", "prefill_ms", "decode_ms", "hook_prefill_us",
                                                      "hook_decode_us")}
        stages = record.get("stages", [])
        lengths = layer_lengths(shape.layers, context["prompt"], text, visual, stages)
        prediction = predict(shape, base_lengths, lengths, new_tokens, batch, context["bytes_per_value"])
        overhead = _overhead(timings, method, base)
        syncs = record.get("syncs", {})
        spreads = [spread([t.e2e_ms for t in runs]), spread([t.e2e_ms for t in base_runs if t is not None])]
        e2e, prefill, decode = stats["e2e_ms"], stats["prefill_ms"], stats["decode_ms"]
        kv = record.get("kv_bytes")
        peak = [t.peak_bytes for t in runs if t.peak_bytes is not None]
        base_peak = [t.peak_bytes for t in base_runs if t is not None and t.peak_bytes is not None]
        speedups = {part: _ratio(base[f"{part}_ms"][50], stats[f"{part}_ms"][50]) for part in ("prefill", "decode",
                                                                                               "e2e")}
        rows.append({
            "geometry": geometry.name, "geometry_key": geometry.key, "family": geometry.family,
            "lm": context["lm_preset"], "batch": batch, "visual_tokens": geometry.visual_tokens(1)[0],
            "visual_per_sample": ";".join(map(str, visual)), "text_tokens": _r(sum(text) / len(text), 1),
            "prompt_tokens": context["prompt"], "method": method, "keep": keep,
            "layer": context["layer"] if context["layer"] is not None else "default",
            "kept_per_stage": ";".join(f"{layer}:{sum(k) / len(k):g}" for layer, k in stages),
            "new_tokens": new_tokens, "repeats": len(runs), "status": record.get("status", "ok"),
            "e2e_base_ms_p50": _r(base["e2e_ms"][50], 2), "e2e_ms_p20": _r(e2e[20], 2), "e2e_ms_p50": _r(e2e[50], 2),
            "e2e_ms_p80": _r(e2e[80], 2), "e2e_spread": _r(spreads[0]),
            "spread_ok": all(not math.isnan(s) and s <= context["max_spread"] for s in spreads),
            "prefill_base_ms_p50": _r(base["prefill_ms"][50], 2), "prefill_ms_p20": _r(prefill[20], 2),
            "prefill_ms_p50": _r(prefill[50], 2), "prefill_ms_p80": _r(prefill[80], 2),
            "decode_base_ms_p50": _r(base["decode_ms"][50], 3), "decode_ms_p20": _r(decode[20], 3),
            "decode_ms_p50": _r(decode[50], 3), "decode_ms_p80": _r(decode[80], 3),
            **{f"speedup_{part}": _r(speedups[part]) for part in speedups},
            **{f"predicted_{part}": _r(prediction[f"predicted_{part}"]) for part in speedups},
            **{f"efficiency_{part}": _r(_ratio(speedups[part], prediction[f"predicted_{part}"])) for part in speedups},
            "throughput_base": _r(_ratio(1000.0 * batch, base["e2e_ms"][50]), 3),
            "throughput": _r(_ratio(1000.0 * batch, e2e[50]), 3), "prefill_gflops": _r(prediction["prefill_gflops"], 2),
            "hook_overhead_us": _r(overhead[0], 1), "hook_overhead_pct": _r(overhead[1], 2),
            "hook_time_prefill_us": _r(stats["hook_prefill_us"][50], 1),
            "hook_time_decode_us": _r(stats["hook_decode_us"][50], 1),
            "hook_time_decode_pct": _r(100.0 * _ratio(stats["hook_decode_us"][50] / 1000.0, decode[50]), 2),
            "syncs_prefill_hooks": _r(syncs.get("prefill_hooks"), 2),
            "syncs_decode_hooks": _r(syncs.get("decode_hooks"), 2),
            "syncs_prefill_delta": _r(_delta(syncs, base_syncs, "prefill_all"), 2),
            "syncs_decode_delta": _r(_delta(syncs, base_syncs, "decode_all"), 2),
            "sync_ops_hooks": ";".join(f"{op}:{n}" for op, n in sorted(syncs.get("ops_hooks", {}).items())),
            "kv_bytes_base": warm.get(("none", 1.0), {}).get("kv_bytes", ""), "kv_bytes": kv if kv is not None else "",
            "kv_bytes_predicted": prediction["kv_bytes_predicted"],
            "kv_error_pct": _r(100.0 * (kv / prediction["kv_bytes_predicted"] - 1.0), 3) if kv else "",
            "peak_mem_base_mb": _r(max(base_peak) / 2**20, 1) if base_peak else "",
            "peak_mem_mb": _r(max(peak) / 2**20, 1) if peak else "", "mem_method": context["mem_method"],
            "lm_hidden": lm.hidden, "lm_layers": lm.layers, "lm_heads": lm.heads, "lm_kv_heads": lm.kv_heads,
            "lm_intermediate": lm.intermediate, "lm_vocab": lm.vocab,
        })
    return rows


def _delta(syncs: dict, base: dict, key: str) -> float:
    if key not in syncs or key not in base:
        return float("nan")
    return syncs[key] - base[key]


def _overhead(timings: dict, method: str, base: dict) -> tuple[float, float]:
    """Decode-step cost of ``method``'s hooks: p50 at keep 1.0 minus the unwrapped p50 (µs, % of the step)."""
    if method == "none":
        return 0.0, 0.0
    runs = [t for t in timings.get((method, 1.0), []) if t is not None]
    step = percentiles([t.decode_ms for t in runs])[50]
    reference = base["decode_ms"][50]
    micro = 1000.0 * (step - reference)
    return micro, 100.0 * _ratio(step - reference, reference)
