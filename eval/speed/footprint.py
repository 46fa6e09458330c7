"""What the engine costs a long-lived server: host time inside the hooks per decode step, host memory a handle
holds after many calls, and host syncs per prefill / decode step (``vtprune bench footprint``).

Writes ``footprint.csv`` and ``footprint.md`` with their conditions. The hook time is measured inside the
hooks (``vtprune.eval.speed.syncs.watch_hooks``), so it is the Python cost a GPU decode step would pay on top of
its kernels; the memory is every object reachable from the handle that is not the model itself.
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from vtprune.eval.provenance import git_state, weights_fingerprint

METHODS = ("fastv", "pdrop", "transprune", "vflowopt", "prefixkv", "visionzip", "divprune", "dart", "random@0")


def reachable_bytes(root: object, skip: tuple[object, ...]) -> int:
    """Bytes of the Python objects and tensors reachable from ``root``, not through ``skip`` nor any module."""
    seen, stack, total = {id(s) for s in skip}, [root], 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, torch.nn.Module)) or callable(item) and item is not root:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
            continue
        total += sys.getsizeof(item)
        stack.extend(gc.get_referents(item))
    return total


def _wrap(model, case: str):
    import vtprune

    method, _, variant = case.partition("@")
    return vtprune.wrap(model, method, keep=0.25, **({"layer": int(variant)} if variant else {}))


def measure(model, inputs: dict, case: str, calls: int, new_tokens: int) -> dict:
    """Hook microseconds per decode step, syncs, and the handle's memory after ``calls`` prefills."""
    from vtprune.eval.speed.syncs import count_syncs, watch_hooks

    handle = _wrap(model, case)
    try:
        with torch.no_grad(), watch_hooks(handle) as hooks:
            model.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
            hooks.reset()
            model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
            decode_us = hooks.per_forward_us("decode")
            prefill_us = hooks.per_forward_us("prefill")
        with torch.no_grad(), watch_hooks(handle) as hooks, \
                count_syncs(only=hooks.inside, group=hooks.phase) as syncs:
            model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        with torch.no_grad():
            for _ in tqdm(range(calls), desc=f"{case}: {calls} calls", unit="call", leave=False):
                model(**inputs, logits_to_keep=1)
        gc.collect()
        memory = reachable_bytes(handle, skip=(model, handle.adapter))
        return {"method": case, "stages": len(handle.stages), "decode_hook_us": round(decode_us, 1),
                "prefill_hook_us": round(prefill_us, 1),
                "decode_syncs": sum(syncs.by_group.get("decode", {}).values()) / max(hooks.forwards["decode"], 1),
                "prefill_syncs": sum(syncs.by_group.get("prefill", {}).values()),
                "calls": calls, "handle_bytes": memory, "stats_entries": len(handle.stats),
                "live_calls": handle.calls.live_calls()}
    finally:
        handle.remove()


def case_list(text: str) -> list[str]:
    """argparse type: comma-separated ``METHOD`` or ``METHOD@LAYER`` cases of methods vtprune has."""
    from vtprune.cli.checks import name_list
    from vtprune.methods import list_methods

    cases = name_list(text).split(",")
    for case in cases:
        method, at, layer = case.partition("@")
        if method.split("+")[0] not in list_methods():
            raise argparse.ArgumentTypeError(f"unknown method {method!r} in {case!r}; see `vtprune info`")
        if at and not layer.isdigit():
            raise argparse.ArgumentTypeError(f"{case!r}: the layer after '@' must be an integer >= 0, e.g. random@0")
    return cases


def main(argv: list[str] | None = None) -> Path:
    from vtprune.cli.checks import OneLineParser, check_output_dir, int_range
    from vtprune.cli.outputs import add_force_argument, check_new_results

    parser = OneLineParser(prog="vtprune bench footprint", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded LLaVA")
    parser.add_argument("--methods", type=case_list, default=",".join(METHODS),
                        help="comma-separated methods, METHOD@LAYER to prune at LAYER")
    parser.add_argument("--calls", type=int_range(1, 10_000_000), default=1000,
                        help="prefills before the memory is measured")
    parser.add_argument("--new-tokens", type=int_range(2, 4096), default=32, help="tokens of the timed decode")
    parser.add_argument("--threads", type=int_range(1, 1024), default=2, help="torch CPU threads")
    parser.add_argument("--out", default="runs/footprint", help="output folder (footprint.csv, footprint.md)")
    add_force_argument(parser)
    args = parser.parse_args(argv)
    from vtprune.models.loading import check_model_spec

    try:
        check_model_spec(args.model)
        out = check_new_results(check_output_dir(args.out), ("footprint.csv", "footprint.md"), args.force)
    except ValueError as error:
        parser.error(str(error))
    import transformers

    from vtprune.models.loading import load, model_label
    from vtprune.models.pipeline import build_inputs
    from vtprune.shapes.task import make_split

    torch.set_num_threads(args.threads)
    model, processor = load(args.model, device="cpu")
    sample = make_split("test", 1)[0]
    inputs = build_inputs(processor, [sample.image], [sample.questions[0].text], model.config.model_type)
    rows = [measure(model, inputs, case, args.calls, args.new_tokens) for case in args.methods]
    conditions = {"model": model_label(args.model), "device": "cpu", "threads": args.threads, "batch_size": 1,
                  "torch": torch.__version__, "transformers": transformers.__version__,
                  **git_state(), "weights_sha": weights_fingerprint(model)}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "footprint.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *conditions])
        writer.writeheader()
        writer.writerows({**r, **conditions} for r in rows)
    (out / "footprint.md").write_text(table(rows, conditions))
    print(table(rows, conditions))
    return out


def table(rows: list[dict], conditions: dict) -> str:
    lines = ["| method | stages | hooks per decode step (µs) | hooks per prefill (µs) | host syncs per decode step | "
             "host syncs per prefill | handle memory after calls | live call states |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['stages']} | {r['decode_hook_us']} | {r['prefill_hook_us']} | "
                     f"{r['decode_syncs']:g} | {r['prefill_syncs']} | {r['handle_bytes'] / 1024:.1f} KiB after "
                     f"{r['calls']} | {r['live_calls']} |")
    c = conditions
    lines.append(f"\nConditions: {c['model']}, {c['device']} ({c['threads']} thread{'' if str(c['threads']) == '1' else 's'}), fp32, SDPA, batch 1, torch "
                 f"{c['torch']}, transformers {c['transformers']}, vtprune @ {c['git_sha']}"
                 f"{' (dirty tree)' if c['git_dirty'] else ''}, weights {c['weights_sha']}. Hook time is measured "
                 "inside the hooks (host Python cost per forward); memory is everything reachable from the handle "
                 "except the model.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
