"""Serving benchmark: vLLM with vtprune's plugin, pruned vs unpruned, as users measure serving (and vs vtprune's
transformers path).

``vtprune bench serving`` (in the vLLM venv; from the main venv it re-runs itself there) sends
``--requests`` requests with distinct random images at each ``--concurrency`` to an in-process vLLM engine
(``AsyncLLM``, what the OpenAI server runs) and records requests/s, time to first token (TTFT), time per
output token (TPOT), KV memory per request and how many requests fit a fixed KV budget
(:mod:`vtprune.eval.speed.serving_kv`), for the unpruned model and each of ``--methods`` at ``--keep`` (pre-LLM
and layer-wise methods side by side, all engines up together); then one ``generate`` loop of vtprune's
transformers path (concurrency 1). Models: ``proxy576x32`` (the default: a random-weight LLaVA at LLaVA-1.5
geometry, 336 px / 14 px patches = 576 visual tokens, with a 32-layer language model 256 wide, vLLM dummy weights),
``proxy576`` (the same with a 4-layer language model 512 wide: a quick run), ``proxy7b`` (LLaVA-1.5-7B's language
model and CLIP-L tower: GPU), ``proxy7bx4`` (four of those language-model layers and the small tower: LLaVA-1.5-7B's
layer geometry on a CPU, where attention is a small share of a layer, as in the real model), and ``embedded:llava``
(16 tokens per image). Each engine's KV blocks per request per layer are read from its own KV managers
(:mod:`vtprune.eval.speed.serving_engines`) next to the formula; with ``--memory-bound N`` the engines run again at
the highest concurrency with a KV cache that holds ``N`` unpruned requests (fewer than the concurrency: memory is
the limit). Writes CSV, Markdown (with conditions) and a plot to
``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROXY_LM = {"proxy576x32": dict(hidden_size=256, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=4,
                                head_dim=64, intermediate_size=704),
            "proxy576": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                             head_dim=64, intermediate_size=1408),
            "proxy7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                            head_dim=128, intermediate_size=11008)}
PROXY_LM["proxy7bx4"] = {**PROXY_LM["proxy7b"], "num_hidden_layers": 4}  # 7B's layers, four of them: a CPU runs it
PROXY_TOWER = {"proxy576": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
               "proxy576x32": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2),
               "proxy7b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)}
PROXY_TOWER["proxy7bx4"] = PROXY_TOWER["proxy576"]  # the small tower: the language model's prefill is what is timed
FIELDS = ["model", "engine", "scenario", "method", "keep", "concurrency", "requests", "visual_tokens", "kept_tokens",
          "req_per_s", "ttft_p50_ms", "tpot_p50_ms", "kv_tokens_per_req", "kv_read_tokens_per_req",
          "kv_blocks_per_req", "kv_mib_per_req", "max_requests_in_budget", "engine_block_size", "kv_blocks_engine",
          "kv_blocks_formula", "kv_budget_mib", "speedup", "vs_transformers"]
BLOCK_FIELDS = ("engine_block_size", "kv_blocks_engine", "kv_blocks_formula")


def proxy_folder(name: str, root: Path) -> Path:
    """A LLaVA folder at LLaVA-1.5 image geometry (576 tokens) with the embedded tokenizer; no weights."""
    from vtprune.vllm.export import export_embedded

    source = export_embedded("llava")
    target = root / name
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix in (".json", ".jinja") and item.name != "config.json":
            (target / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["text_config"].update(PROXY_LM[name], max_position_embeddings=4096)
    config["vision_config"].update(PROXY_TOWER[name], image_size=336, patch_size=14)
    config["image_seq_length"] = 576
    (target / "config.json").write_text(json.dumps(config, indent=2))
    processor = json.loads((source / "processor_config.json").read_text())
    processor["patch_size"] = 14
    processor["image_processor"].update(crop_size={"height": 336, "width": 336}, size={"shortest_edge": 336})
    (target / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return target


async def run_load(engine, prompt: str, pictures: list, concurrency: int, max_tokens: int) -> tuple[list, float]:
    """Send one request per picture, at most ``concurrency`` in flight; per-request records and wall seconds."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, picture) -> dict:
        async with gate:
            start, first, last, tokens, prompt_tokens = time.perf_counter(), None, None, 0, 0
            request = {"prompt": prompt, "multi_modal_data": {"image": picture}}
            async for out in engine.generate(request, params, request_id=f"r{index}-{time.monotonic_ns()}"):
                now = time.perf_counter()
                tokens, prompt_tokens = len(out.outputs[0].token_ids), len(out.prompt_token_ids or [])
                first = now if first is None and tokens else first
                last = now
            return {"ttft": first - start, "tpot": (last - first) / max(tokens - 1, 1), "prompt": prompt_tokens,
                    "output": tokens}

    start = time.perf_counter()
    records = await asyncio.gather(*(one(i, p) for i, p in enumerate(pictures)))
    return list(records), time.perf_counter() - start


def summary(model: str, engine: str, method: str, keep: float, concurrency: int, records: list, seconds: float,
            config: dict, visual: int, kept: int, args: argparse.Namespace) -> dict:
    from vtprune.eval.speed.serving_kv import kv_fields, value_bytes

    tokens = statistics.mean(r["prompt"] + r["output"] for r in records)
    row = {"model": model, "engine": engine, "scenario": "", "method": method, "keep": keep, "concurrency": concurrency,
           "requests": len(records), "visual_tokens": visual, "kept_tokens": kept,
           "req_per_s": round(len(records) / seconds, 3),
           "ttft_p50_ms": round(1000 * statistics.median(r["ttft"] for r in records), 1),
           "tpot_p50_ms": round(1000 * statistics.median(r["tpot"] for r in records), 2), "speedup": "",
           "vs_transformers": "", "kv_budget_mib": "", **dict.fromkeys(BLOCK_FIELDS, "")}
    row.update(kv_fields(method, keep, config["text_config"], visual, tokens, args.block_size, args.kv_budget_gib,
                         value_bytes(args.dtype)))
    return row


def kept_tokens(method: str, keep: float, visual: int, num_layers: int) -> int:
    """Visual tokens the last stage keeps (all for ``none``): a pre-LLM method before the language model, a
    layer-wise one after its last stage."""
    from vtprune.vllm.select import kept_count
    from vtprune.vllm.settings import is_layer_wise, is_retention

    if method == "none":
        return visual
    if is_retention(method):  # every layer keeps its own entries: keep of them on average
        return kept_count(keep, visual)
    if is_layer_wise(method):
        from vtprune.vllm.layerwise.plan import make_layer_plan

        return make_layer_plan(method, keep, num_layers).kept_counts(visual, keep)[-1]
    return kept_count(keep, visual)


def measure_vllm(model: str, folder: Path, methods: list[str], keep: float, args: argparse.Namespace,
                 levels: list[int] | None = None, kv_bytes: int | None = None) -> list[dict]:
    """Rows of one engine per method (``none``: unpruned), measured in alternation at every concurrency of
    ``levels`` (default ``--concurrency``), with a KV cache of ``kv_bytes`` (default: the engine's own size)."""
    return asyncio.run(_measure_vllm(model, folder, methods, keep, args, levels or args.concurrency, kv_bytes))


def _engine(folder: Path, model: str, method: str, keep: float, args: argparse.Namespace, kv_bytes: int | None):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vtprune.eval.speed.serving_engines import engine_options, kv_space

    with kv_space(kv_bytes):
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_options(folder, model, method, keep, args, kv_bytes)))


async def _measure_vllm(model: str, folder: Path, methods: list[str], keep: float, args: argparse.Namespace,
                        levels: list[int], kv_bytes: int | None) -> list[dict]:
    """Both engines stay up; each concurrency level runs ``--rounds`` times, the engines taking turns, so a busy
    machine slows both alike; a row reports the median round's requests/s and the pooled TTFT / TPOT."""
    config = json.loads((folder / "config.json").read_text())
    size = config["vision_config"]["image_size"]
    visual = (size // config["vision_config"]["patch_size"]) ** 2
    layers = config["text_config"]["num_hidden_layers"]
    engines = {method: _engine(folder, model, method, keep, args, kv_bytes) for method in methods}
    rows = []
    try:
        from vtprune.eval.speed.serving_engines import images, prompt_text

        prompt = prompt_text(engines[methods[0]].get_tokenizer())
        for engine in engines.values():
            await run_load(engine, prompt, images(2, size, seed=99), 2, args.max_tokens)  # warm-up
        for concurrency in levels:
            count = max(args.requests, 2 * concurrency)
            runs: dict[str, list] = {method: [] for method in methods}
            for round_index in range(args.rounds):
                for method, engine in engines.items():
                    pictures = images(count, size, seed=1000 * concurrency + round_index)
                    runs[method].append(await run_load(engine, prompt, pictures, concurrency, args.max_tokens))
            for method in methods:
                ordered = sorted(runs[method], key=lambda run: len(run[0]) / run[1])
                records, seconds = ordered[len(ordered) // 2]
                row = summary(model, "vllm", method, keep if method != "none" else 1.0, concurrency,
                              [r for run, _ in runs[method] for r in run], seconds, config, visual,
                              kept_tokens(method, keep, visual, layers), args)
                row["requests"], row["req_per_s"] = len(records), round(len(records) / seconds, 3)
                row["scenario"] = "default KV" if kv_bytes is None else "memory-bound"
                row["kv_budget_mib"] = "" if kv_bytes is None else round(kv_bytes / 2**20, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rows


class _Clock:
    """A transformers streamer that timestamps the first new token and the last one."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def put(self, value) -> None:
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


def measure_transformers(model_name: str, folder: Path, method: str, keep: float, args: argparse.Namespace
                         ) -> dict:
    """One row of vtprune's transformers path: a ``generate`` loop (concurrency 1), wrapped unless ``none``."""
    import torch
    from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

    import vtprune
    from vtprune.vllm.settings import is_layer_wise

    config = json.loads((folder / "config.json").read_text())
    torch.manual_seed(0)
    if model_name.startswith("proxy"):
        model = LlavaForConditionalGeneration(LlavaConfig.from_pretrained(folder)).eval()
    else:
        model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    handle = vtprune.wrap(model, method, keep=keep) if method != "none" else None
    size = config["vision_config"]["image_size"]
    visual = (size // config["vision_config"]["patch_size"]) ** 2
    from vtprune.eval.speed.serving_engines import images, prompt_text

    records, prompt = [], prompt_text(processor)
    pictures = images(args.transformers_requests + 1, size, seed=7)
    start = None
    for index, picture in enumerate(pictures):
        if index == 1:
            start = time.perf_counter()  # the first request warms up
        inputs = processor(images=picture, text=prompt, return_tensors="pt")
        clock, begin = _Clock(), time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                           do_sample=False, streamer=clock)
        if index:
            stamps = clock.calls[1:]  # the first put is the prompt
            records.append({"ttft": stamps[0] - begin, "tpot": (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1),
                            "prompt": int(inputs["input_ids"].shape[1]), "output": len(stamps)})
    seconds = time.perf_counter() - start
    if handle is not None:
        handle.remove()
    kept = kept_tokens(method, keep, visual, config["text_config"]["num_hidden_layers"])
    if method != "none" and not is_layer_wise(method):  # the transformers path's prompt holds every placeholder
        for record in records:
            record["prompt"] -= visual - kept
    row = summary(model_name, "transformers", method, keep if method != "none" else 1.0, 1, records, seconds,
                  config, visual, kept, args)
    print(json.dumps(row), flush=True)
    return row


def median_transformers(rows: list[dict]) -> list[dict]:
    """One transformers row per (model, method): the round with the median requests/s."""
    out, groups = [], {}
    for row in rows:
        if row["engine"] != "transformers":
            out.append(row)
        else:
            groups.setdefault((row["model"], row["method"]), []).append(row)
    for group in groups.values():
        out.append(sorted(group, key=lambda r: r["req_per_s"])[len(group) // 2])
    return out


def add_speedups(rows: list[dict]) -> None:
    """``speedup``: requests/s over the unpruned row of the same model, engine and concurrency;
    ``vs_transformers``: over vtprune's transformers path (same model and method, one request at a time)."""
    base = {(r["model"], r["engine"], r["scenario"], r["concurrency"]): r["req_per_s"] for r in rows
            if r["method"] == "none"}
    loop = {(r["model"], r["method"]): r["req_per_s"] for r in rows if r["engine"] == "transformers"}
    for row in rows:
        unpruned = base.get((row["model"], row["engine"], row["scenario"], row["concurrency"]))
        row["speedup"] = round(row["req_per_s"] / unpruned, 2) if unpruned else ""
        transformers = loop.get((row["model"], row["method"]))
        row["vs_transformers"] = round(row["req_per_s"] / transformers, 2) if transformers else ""


def conditions(args: argparse.Namespace) -> str:
    import torch
    import vllm
    from vtprune.eval.speed.serving_kv import value_bytes

    import vtprune

    source = Path(vtprune.__file__).resolve().parents[1]  # the checkout the engines import (a worktree, maybe)
    sha = subprocess.run(["git", "describe", "--always", "--dirty=+changes"], cwd=source, capture_output=True,
                         text=True).stdout
    return (f"vLLM {vllm.__version__} ({'CPU' if not torch.cuda.is_available() else torch.cuda.get_device_name()}), "
            f"torch {torch.__version__}, {args.dtype}, vLLM's default compile mode (the plugin's "
            f"layer-wise methods and PrefixKV compiled), {os.cpu_count()} cores "
            f"(OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')}), Python {platform.python_version()}, "
            f"vtprune {sha.strip() or '?'}; requests per concurrency max({args.requests}, 2 x concurrency), "
            f"pruned and unpruned engines up together and measured in {args.rounds} alternating rounds (median "
            "round's requests/s; TTFT / TPOT medians over all rounds), "
            f"{args.max_tokens} output tokens each (ignore_eos), distinct random images; transformers path: "
            f"{args.transformers_requests} requests, one at a time; KV per request: each layer's tokens (a layer-wise "
            "method's pruned layers hold only the kept ones) in blocks of "
            f"{args.block_size} tokens x 2 x KV heads x head dim x {value_bytes(args.dtype)} bytes, summed over "
            "layers; kv_blocks_per_req = "
            f"those blocks / layers; max_requests_in_budget = requests whose KV fits {args.kv_budget_gib} GiB; "
            "kv_blocks_engine: one request alone, its blocks read from the engine's KV managers at its last step, per "
            "layer, at the engine's block size (engine_block_size), next to the formula at that block size "
            "(kv_blocks_formula)" + (f"; memory-bound rows: the engines restarted with a KV cache of kv_budget_mib, "
                                     f"which holds {args.memory_bound} unpruned requests, at concurrency "
                                     f"{max(args.concurrency)}" if args.memory_bound else "") + ".")


def write(rows: list[dict], out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serving.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# Serving: vLLM with vtprune's plugin, pruned vs unpruned", "", f"Conditions: {conditions(args)}", "",
             "| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(row[f]) for f in FIELDS) + " |" for row in rows]
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    (out / "conditions.txt").write_text(conditions(args) + "\n")
    plot(out)


def plot(out: Path) -> None:
    """``serving.png``: requests/s against concurrency per model and method (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_serving: no matplotlib here; run `vtprune bench serving --plot-only "
              f"{out}` in the main venv for the plot", file=sys.stderr)
        return
    with open(out / "serving.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r["engine"] == "vllm" and r.get("scenario") != "memory-bound"]
    models = sorted({r["model"] for r in rows})
    figure, axes = plt.subplots(len(models), 2, figsize=(10, 4 * len(models)), squeeze=False)
    for (speed, memory), model in zip(axes, models):
        methods = sorted({r["method"] for r in rows if r["model"] == model}, key=lambda m: (m != "none", m))
        for method in methods:
            chosen = [r for r in rows if r["model"] == model and r["method"] == method]
            speed.plot([int(r["concurrency"]) for r in chosen], [float(r["req_per_s"]) for r in chosen], marker="o",
                       label=f"{method} keep {chosen[0]['keep']}")
        speed.set(xscale="log", xlabel="concurrency", ylabel="requests/s", title=f"{model}: throughput")
        speed.legend()
        budget = [next(int(r["max_requests_in_budget"]) for r in rows if r["model"] == model and r["method"] == m)
                  for m in methods]
        memory.bar(methods, budget, color=[f"C{i}" for i in range(len(methods))])
        memory.set(ylabel="requests whose KV fits the budget", title=f"{model}: KV budget (see conditions)")
    figure.suptitle(textwrap.fill((out / "conditions.txt").read_text().strip(), 180), fontsize=6)
    figure.tight_layout()
    figure.savefig(out / "serving.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    from vtprune.eval.speed.serving_options import parse

    args = parse(argv)
    if args.plot_only:
        plot(Path(args.plot_only))
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        from vtprune.vllm.serve import vllm_python

        forwarded = sys.argv[1:] if argv is None else argv
        return subprocess.call([vllm_python(), "-m", "vtprune.eval.speed.serving", *forwarded])
    from vtprune.eval.speed.serving_engines import engine_blocks, memory_bound

    from vtprune.vllm.export import cache_root, model_folder

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on a CPU (ignored on a GPU)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the plugin's layer-wise methods run on
    out = Path(args.out)
    rows: list[dict] = []
    for model in args.models.split(","):
        folder = proxy_folder(model, cache_root()) if model.startswith("proxy") else Path(model_folder(model))
        methods = ["none", *args.methods]
        blocks = {method: engine_blocks(folder, model, method, args.keep, args) for method in methods}
        print(json.dumps({"model": model, "blocks": blocks}), flush=True)
        measured = measure_vllm(model, folder, methods, args.keep, args)
        if args.memory_bound:
            bound, budget = memory_bound(folder, args.memory_bound, blocks["none"]["engine_block_size"], args)
            measured += measure_vllm(model, folder, methods, args.keep, bound, [max(args.concurrency)], budget)
        for row in measured:
            row.update(blocks[row["method"]])
        rows += measured
        for _ in range(args.transformers_requests and args.rounds):  # alternating rounds too
            for method in ("none", *args.methods):
                rows.append(measure_transformers(model, folder, method, args.keep, args))
        rows = median_transformers(rows)
    add_speedups(rows)
    write(rows, out, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
