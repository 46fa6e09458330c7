"""``vtprune bench``: accuracy, evidence recall and cost of every method x keep on the vtprune-shapes task.

One CSV row per model x method x keep x question type (plus ``all``), with the run conditions; then a
Markdown table and PNG plots (``vtprune.eval.accuracy.report``). Speed on realistic geometry is measured by
``--speed`` (or ``vtprune bench speed``) on a random-weight speed-proxy model (``vtprune.eval.speed.bench``);
``vtprune bench KIND`` runs the other benchmarks (:data:`vtprune.cli.commands.BENCH_KINDS`).
"""

from __future__ import annotations

import argparse
import csv
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm
from vtprune.eval.accuracy.defaults import DEFAULT_KEEPS, DEFAULT_METHODS
from vtprune.eval.speed.bench import add_speed_arguments

from vtprune.cli.checks import (
    ATTN_IMPLEMENTATIONS,
    DTYPE_NAMES,
    check_output_dir,
    int_range,
    keep_list,
    known_methods,
    name_list,
    positive_int,
)
from vtprune.cli.outputs import add_force_argument, check_new_results
from vtprune.errors import UserError

if TYPE_CHECKING:
    import torch

SPLITS = ("train", "val", "test", "calib")
RESULTS = ("bench.csv", "bench.md")  # what an earlier run left in --out (the plots are redrawn from the CSV)


@dataclass
class Item:
    """One question about one image, with its evidence as a visual-token mask (filled at run time)."""

    image: object
    question: str
    answer: str
    qtype: str
    boxes: list


def load_items(split: str, n_images: int, task: str = "shapes") -> list[Item]:
    """Every question of the first ``n_images`` images of ``split`` of the task version ``task``
    (``"shapes"``: 112 px, 16 tokens on the embedded models; ``"dense"``: 224 px, 6-12 objects, ``where3``)."""
    if task == "dense":
        from vtprune.shapes.dense import make_dense_split as make_split
    else:
        from vtprune.shapes.task import make_split

    return [Item(s.image, q.text, q.answer, q.qtype, q.boxes) for s in make_split(split, n_images)
            for q in s.questions]


def task_for(model_spec: str | None, task: str) -> str:
    """``--task auto``: the dense version for the 64-token embedded LLaVA, the first version otherwise."""
    from vtprune.models.embedded import task_of

    return task_of(model_spec) if task == "auto" else task


def evidence_weights(item: Item, segments) -> torch.Tensor:
    """``[N]`` 1.0 on the visual tokens covered by the answer object's boxes (first image's grid)."""
    import torch

    from vtprune.shapes.task import evidence_mask

    segment = segments[0]
    mask = evidence_mask(item.boxes, item.image.size, segment.h, segment.w) if item.boxes else np.zeros(
        segment.h * segment.w, dtype=bool)
    weights = torch.zeros(segment.length)
    weights[: mask.size] = torch.from_numpy(mask.astype(np.float32))
    return weights


def normalise(text: str) -> str:
    return text.strip().lower().rstrip(".").replace(" ", "-")


def evaluate(model, processor, items: list[Item], method: str, keep: float, batch_size: int,
             progress: tqdm | None = None) -> list[dict]:
    """Answer every item with ``method`` at ``keep``; one record per item (correct, recall, kept)."""
    import torch
    from vtprune.adapters import get_adapter

    import vtprune
    from vtprune.models.pipeline import build_inputs

    adapter = get_adapter(model)
    handle = vtprune.wrap(model, method, keep=keep)
    records = []
    try:
        for start in range(0, len(items), batch_size):
            batch = items[start:start + batch_size]
            inputs = build_inputs(processor, [i.image for i in batch], [i.question for i in batch],
                                  model.config.model_type)
            segments = adapter.segments(inputs["input_ids"], inputs)
            evidence = [evidence_weights(item, seg) for item, seg in zip(batch, segments)]
            handle.set_evidence(evidence)
            with torch.inference_mode():
                output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
            texts = processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            stats = handle.last_stats
            for row, (item, text) in enumerate(zip(batch, texts)):
                records.append(_record(item, text, evidence[row], stats, row))
            if progress is not None:
                progress.update(len(batch))
    finally:
        handle.remove()
    return records


def _record(item: Item, text: str, evidence: torch.Tensor, stats, row: int) -> dict:
    total = stats.visual_tokens[row] if stats else int(evidence.numel())
    # Sequence pruning: what the last stage kept. KV retention (prefixkv): each layer's cache, averaged.
    kv = bool(stats and stats.retained_kv)
    kept_sets = [s[row] for s in stats.kept_indices] if stats and stats.kept_indices else [list(range(total))]
    kept_sets = kept_sets if kv else kept_sets[-1:]
    ev = evidence.nonzero().flatten().tolist()
    recall = float(np.mean([len(set(ev) & set(k)) / len(ev) for k in kept_sets])) if ev else float("nan")
    return {"qtype": item.qtype, "correct": float(normalise(text) == normalise(item.answer)), "recall": recall,
            "visual": total, "kept": [s[row] for s in stats.kept] if stats else [],
            "stages": list(stats.stage_layers) if stats else [], "kv": kv}


def timing_ms(model, processor, items: list[Item], method: str, keep: float, repeats: int) -> dict:
    """p20/p50/p80 of prefill and of one decode step, batch 1, after a warm-up, for ``method`` at ``keep``.

    Prefill is one forward pass. A decode step is ``generate`` of two tokens minus ``generate`` of one (the
    model's own decoding path, which also builds Qwen's M-RoPE decode positions), so it includes the
    per-step overhead of ``generate``.
    """
    import torch

    import vtprune
    from vtprune.models.pipeline import build_inputs

    prefill, decode = [], []
    with vtprune.apply(model, method, keep=keep) as handle, torch.inference_mode():
        for item in items:
            inputs = build_inputs(processor, [item.image], [item.question], model.config.model_type)
            handle.set_evidence([torch.zeros(4096)])
            for step in range(repeats + 1):
                start = time.perf_counter()
                model(**inputs, use_cache=True, logits_to_keep=1)
                middle = time.perf_counter()
                model.generate(**inputs, max_new_tokens=1, do_sample=False)
                one = time.perf_counter()
                model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                end = time.perf_counter()
                if step:
                    prefill.append((middle - start) * 1000)
                    decode.append(max(0.0, (end - one) - (one - middle)) * 1000)
    q = lambda values, p: float(np.percentile(values, p))  # noqa: E731
    return {f"{name}_ms_p{p}": round(q(values, p), 3) for name, values in (("prefill", prefill), ("decode", decode))
            for p in (20, 50, 80)}


def cost(model, records: list[dict], text_tokens: int) -> dict:
    """Theoretical prefill FLOPs and KV bytes for the mean kept counts of ``records`` (batch 1)."""
    from vtprune.flops import LMShape, kv_cache_bytes, prefill_flops, tokens_per_layer

    shape = LMShape.from_config(model.config)
    visual = int(round(np.mean([r["visual"] for r in records])))
    stages = [(layer, int(round(np.mean([r["kept"][i] for r in records]))))
              for i, layer in enumerate(records[0]["stages"])] if records[0]["stages"] else []
    full = tokens_per_layer(shape, text_tokens, visual, [])
    if records[0].get("kv"):  # KV retention: the prefill sees every token; each layer caches its own subset
        per_layer, cached = full, [text_tokens + n for _, n in stages]
    else:
        per_layer = cached = tokens_per_layer(shape, text_tokens, visual, stages)
    flops = prefill_flops(shape, per_layer)
    return {"prefill_gflops": round(flops / 1e9, 6), "flops_ratio": round(flops / prefill_flops(shape, full), 4),
            "kv_cache_bytes": kv_cache_bytes(shape, cached, next(model.parameters()).element_size()),
            "kept_per_stage": ";".join(f"{layer}:{n}" for layer, n in stages)}


def summarise(records: list[dict]) -> dict[str, dict]:
    """Accuracy and evidence recall per question type and overall."""
    groups = defaultdict(list)
    for r in records:
        groups[r["qtype"]].append(r)
        groups["all"].append(r)
    out = {}
    for qtype, rows in groups.items():
        recalls = [r["recall"] for r in rows if not np.isnan(r["recall"])]
        out[qtype] = {"n": len(rows), "accuracy": round(float(np.mean([r["correct"] for r in rows])), 4),
                      "evidence_recall": round(float(np.mean(recalls)), 4) if recalls else float("nan"),
                      "mean_kept": round(float(np.mean([r["kept"][-1] if r["kept"] else r["visual"] for r in rows])), 2)}
    return out


def run(args: argparse.Namespace) -> Path:
    """The whole benchmark; returns the CSV path."""
    import torch
    from vtprune.eval.accuracy.report import conditions, write_report

    from vtprune.models.loading import load, model_label

    methods = known_methods([m for m in args.methods.split(",") if m])
    keeps = [float(k) for k in args.keep.split(",") if k]
    out = check_new_results(check_output_dir(args.out), RESULTS, args.force)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    task = task_for(args.model, getattr(args, "task", "auto"))
    items = load_items(args.split, args.images, task)
    out.mkdir(parents=True, exist_ok=True)
    env = conditions(model, args)
    text_tokens = _text_tokens(model, processor, items[0])
    rows = []
    plan = bench_plan(methods, keeps)
    if 1.0 in keeps and any(m != "none" for m in methods):
        print("[bench] keep 1 runs once, as 'none': at keep 1 every method keeps every visual token")
    progress = tqdm(total=len(plan) * len(items), desc="bench", unit="q")
    for method, keep in plan:
        records = evaluate(model, processor, items, method, keep, args.batch_size, progress)
        timing = timing_ms(model, processor, items[: args.timing_samples], method, keep, args.repeats)
        common = {"model": model_label(args.model), "task": task, "method": method, "keep": keep,
                  **cost(model, records, text_tokens), **timing, **env}
        for qtype, summary in summarise(records).items():
            rows.append({**common, "qtype": qtype, **summary})
    progress.close()
    path = out / "bench.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_report(path, out)
    print()
    print((out / "bench.md").read_text())
    print(f"[bench] wrote {path}, {out / 'bench.md'} and plots ({out}/*.png)")
    return path


def bench_plan(methods: list[str], keeps: list[float]) -> list[tuple[str, float]]:
    """``(method, keep)`` runs: the unpruned reference ``none`` at keep 1 once, then every method below keep 1.

    At keep 1 every method keeps every visual token and equals the unpruned model
    (``tests/engine/test_contract.py``), so its rows would repeat ``none``'s; ``none`` runs when it is listed or
    when keep 1 is asked for.
    """
    plan = [("none", 1.0)] if "none" in methods or 1.0 in keeps else []
    return plan + [(m, k) for m in methods if m != "none" for k in keeps if k < 1.0]


def _text_tokens(model, processor, item: Item) -> int:
    from vtprune.adapters import get_adapter

    from vtprune.models.pipeline import build_inputs

    ids = build_inputs(processor, [item.image], [item.question], model.config.model_type)["input_ids"]
    return int(ids.shape[1] - get_adapter(model).visual_mask(ids).sum())


def register(subparsers: argparse._SubParsersAction) -> None:
    from vtprune.cli.commands import BENCH_KINDS, bench_kinds_help

    parser = subparsers.add_parser("bench", help="accuracy / evidence recall / cost of methods x keep fractions",
                                   description=bench_kinds_help())
    parser.add_argument("kind", nargs="?", default="accuracy", choices=BENCH_KINDS, metavar="KIND",
                        help="what to measure (default accuracy; the kinds are listed above)")
    parser.add_argument("--model", default=None,
                        help="model folder or hub id (default: the embedded LLaVA, 'embedded:llava')")
    parser.add_argument("--attn", default="sdpa", choices=ATTN_IMPLEMENTATIONS, help="attn_implementation")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, type=name_list,
                        help="comma-separated methods ('none' is the unpruned reference)")
    parser.add_argument("--keep", default=DEFAULT_KEEPS, type=keep_list,
                        help="comma-separated keep fractions (keep 1 runs once, as 'none')")
    parser.add_argument("--split", default="test", choices=SPLITS, help="vtprune-shapes split")
    parser.add_argument("--task", default="auto", choices=("auto", "shapes", "dense"),
                        help="task version: shapes (112 px, the 16-token models) or dense (224 px, 6-12 objects, "
                             "3x3 where; the 64-token model); auto picks dense for embedded:llava64")
    parser.add_argument("--images", type=int_range(1, 100_000), default=100,
                        help="images of the split (about 6 questions each)")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="questions per generate() call")
    parser.add_argument("--timing-samples", type=int_range(1, 10_000), default=4,
                        help="questions timed at batch 1 for the prefill / decode columns")
    parser.add_argument("--repeats", type=int_range(1, 1000), default=3, help="timed repeats per question")
    parser.add_argument("--threads", type=int_range(0, 1024), default=1,
                        help="torch CPU threads (0: as many as torch picks; 1 avoids thread thrashing on shared CPUs)")
    parser.add_argument("--out", default="runs/bench", help="output folder (CSV, Markdown table, plots)")
    add_force_argument(parser)
    parser.add_argument("--speed", action="store_true",
                        help="run the speed benchmark on a random-weight speed-proxy model instead")
    parser.add_argument("--speed-hidden", type=positive_int, default=1024, help="speed proxy: LM hidden size")
    parser.add_argument("--speed-layers", type=positive_int, default=16, help="speed proxy: LM layers")
    parser.add_argument("--speed-tokens", default="576,2880",
                        help="speed: geometries, comma-separated 576, 2880 (alias 2916), 2304, 16384, video, or all")
    parser.add_argument("--layer", type=int_range(0), default=None,
                        help="speed proxy: pruning layer (default: the method's)")
    add_speed_arguments(parser)
    video = parser.add_argument_group("video (--video; --methods/--keep/--out default to none,fastv / 1,0.25 / "
                                      "runs/bench_video)")
    video.add_argument("--video", action="store_true",
                       help="video split: all K^2 frames vs uniform M_eff vs GridProbe, x token methods")
    video.add_argument("--clips", type=int_range(1, 100_000), default=20, help="video: clips (2 questions each)")
    video.add_argument("--k", type=int_range(1, 16), default=None,
                       help="video: GridProbe grid side K (default: largest K <= 4 whose K^2 frames fit the context)")
    video.add_argument("--answer", default="generate", choices=("generate", "score"),
                       help="video: generate and parse the letter (option text mapped) or argmax of letter scores")
    video.add_argument("--open-ended", action="store_true",
                       help="video: ask without the A-D options (GridProbe scores the peak first-token "
                            "probability); answers are mapped to the options")
    video.add_argument("--route", default="auto", choices=("auto", "video", "images"),
                       help="video: frame route (auto: the model's video processor when available)")
    video.add_argument("--probe-pixels", type=int_range(28 * 28, 1024 * 1024), default=224 * 224,
                       help="video: pixels per frame in the probes")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from vtprune.cli.commands import BENCH_KINDS
    from vtprune.models.loading import check_attention, check_device, check_load

    if BENCH_KINDS[args.kind][0] is not None:
        raise UserError(f"write the kind right after bench: vtprune bench {args.kind} ... "
                        f"(its options are its own; vtprune bench {args.kind} --help lists them)")
    args.speed = args.speed or args.kind == "speed"
    args.video = args.video or args.kind == "video"
    check_device(args.device)
    check_attention(args.attn, args.device)
    if not args.speed:
        check_load(args.model, args.device, args.attn, args.dtype)
    if args.video:
        from vtprune.eval.accuracy.video import run_video

        run_video(args)
    elif args.speed:
        from vtprune.eval.speed.bench import run_speed

        run_speed(args)
    else:
        run(args)
    return 0
