"""``vtprune bench --speed``: measured prefill speedup versus the FLOP-predicted one on a speed-proxy model.

The proxy runs the real code path (``LlavaForConditionalGeneration`` with random weights) at realistic LM
geometry (hidden 1024, 16 layers by default) with 576 or 2916 visual tokens (LLaVA-1.5 and roughly
LLaVA-NeXT sized); the vision tower is kept tiny so the language model dominates, as on a 7B model.
Baseline and method run on the same attention backend after a warm-up. The scoring/hook overhead is the
pruned method at ``keep=1.0`` (everything scored, nothing dropped) minus the baseline.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

GEOMETRIES = {"llava-1.5 (576)": 336, "llava-next-like (2916)": 756}


def speed_proxy(image_size: int, hidden: int, layers: int, attn: str, dtype: torch.dtype, device: str):
    """A random-weight LLaVA whose LM has realistic width/depth and a one-layer 64-wide vision tower."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=8192)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=14)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=1000, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device).eval()


def proxy_inputs(model, image_size: int, text_tokens: int = 48, device: str = "cpu") -> dict:
    visual = (image_size // 14) ** 2
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, 900, (1, 8), generator=generator)
    suffix = torch.randint(2, 900, (1, text_tokens - 8), generator=generator)
    ids = torch.cat([prefix, torch.full((1, visual), 1000), suffix], dim=1)
    pixels = torch.randn(1, 3, image_size, image_size, generator=generator, dtype=torch.float32)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "pixel_values": pixels.to(device=device, dtype=next(model.parameters()).dtype)}


def time_prefill(model, inputs: dict, repeats: int) -> list[float]:
    device = inputs["input_ids"].device
    times = []
    with torch.inference_mode():
        for step in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(**inputs, use_cache=True, logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step:
                times.append((time.perf_counter() - start) * 1000.0)
    return times


def measure(model, inputs: dict, method: str, keep: float, layer: int | None, repeats: int) -> list[float]:
    import vtprune

    if method == "none":
        return time_prefill(model, inputs, repeats)
    options = {"layer": layer} if layer is not None else {}
    with vtprune.apply(model, method, keep=keep, **options):
        return time_prefill(model, inputs, repeats)


def predicted_speedup(model, visual: int, text: int, method: str, keep: float, layer: int | None) -> float:
    from vtprune.api import wrap
    from vtprune.config import keep_count
    from vtprune.flops import LMShape, prefill_flops, tokens_per_layer

    shape = LMShape.from_config(model.config)
    handle = wrap(model, method, keep=keep, **({"layer": layer} if layer is not None else {}))
    stages = [(s.layer, keep_count(s.keep, visual)) for s in handle.stages]
    handle.remove()
    base = prefill_flops(shape, tokens_per_layer(shape, text, visual, []))
    return base / prefill_flops(shape, tokens_per_layer(shape, text, visual, stages))


def run_speed(args: argparse.Namespace) -> Path:
    import transformers
    from vtprune.eval.bench_report import git_sha

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    methods = [m for m in args.methods.split(",") if m and m not in ("none", "oracle")]
    keeps = [float(k) for k in args.keep.split(",") if float(k) < 1.0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    geometries = {k: v for k, v in GEOMETRIES.items() if args.speed_tokens in ("all", k.split("(")[1][:-1])}
    for name, size in tqdm(geometries.items(), desc="speed", unit="geometry"):
        model = speed_proxy(size, args.speed_hidden, args.speed_layers, args.attn, dtype, device)
        inputs = proxy_inputs(model, size, device=device)
        visual = (size // 14) ** 2
        text = inputs["input_ids"].shape[1] - visual
        base = time_prefill(model, inputs, args.repeats)
        for method in methods:
            overhead = measure(model, inputs, method, 1.0, args.layer, args.repeats)
            for keep in keeps:
                pruned = measure(model, inputs, method, keep, args.layer, args.repeats)
                measured = float(np.median(base) / np.median(pruned))
                predicted = predicted_speedup(model, visual, text, method, keep, args.layer)
                rows.append({
                    "geometry": name, "visual_tokens": visual, "method": method, "keep": keep,
                    "baseline_ms_p50": round(float(np.median(base)), 2),
                    "pruned_ms_p20": round(float(np.percentile(pruned, 20)), 2),
                    "pruned_ms_p50": round(float(np.median(pruned)), 2),
                    "pruned_ms_p80": round(float(np.percentile(pruned, 80)), 2),
                    "speedup_measured": round(measured, 3), "speedup_flops": round(predicted, 3),
                    "efficiency": round(measured / predicted, 3),
                    "scoring_overhead_pct": round(100 * (np.median(overhead) / np.median(base) - 1), 2),
                    "hidden": args.speed_hidden, "layers": args.speed_layers, "attn_implementation": args.attn,
                    "dtype": args.dtype, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "threads": torch.get_num_threads(), "batch_size": 1, "torch": torch.__version__,
                    "transformers": transformers.__version__, "git_sha": git_sha(),
                })
        del model
    path = out / "speed.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "speed.md").write_text(speed_table(rows))
    print(f"[bench] wrote {path} and {out / 'speed.md'}")
    return path


def speed_table(rows: list[dict]) -> str:
    lines = ["| geometry | method | keep | baseline ms | pruned ms (p20/p50/p80) | measured speedup | "
             "FLOP-predicted | efficiency | scoring overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['geometry']} | {r['method']} | {r['keep']:g} | {r['baseline_ms_p50']} | "
                     f"{r['pruned_ms_p20']}/{r['pruned_ms_p50']}/{r['pruned_ms_p80']} | {r['speedup_measured']}x | "
                     f"{r['speedup_flops']}x | {r['efficiency']:.0%} | {r['scoring_overhead_pct']}% |")
    first = rows[0]
    lines.append(f"\nConditions: speed-proxy LLaVA (random weights, hidden {first['hidden']}, {first['layers']} "
                 f"layers), {first['device']} ({first['threads']} threads), {first['dtype']}, "
                 f"{first['attn_implementation']}, batch 1, torch {first['torch']}, transformers "
                 f"{first['transformers']}, vtprune @ {first['git_sha']}.")
    return "\n".join(lines) + "\n"
