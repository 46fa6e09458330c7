"""The engine's contract on a GPU: keep=1 identity, batch == alone, and cached decoding == the independent
reference, for SDPA and FlashAttention-2 (when flash-attn imports), in bf16 on tiny models.

Run by ``scripts/gpu_check.sh``; writes ``contract.json`` and ``contract.md`` under ``--out``. Runs on CPU too
(``--device cpu``, fp32, SDPA only) as a dry run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from independent_reference import reference_decode  # noqa: E402

import vtprune  # noqa: E402
from vtprune.models.tiny import SPECIAL_TOKENS, random_image, tiny_inputs, tiny_model  # noqa: E402

# vflowopt and visionzip without their merge steps: the reference gathers tokens (merges are tested on CPU)
CASES = [("fastv", {}), ("pdrop", {}), ("transprune", {}), ("random", {"layer": 0}), ("vflowopt", {"recycle": False}),
         ("visionzip", {"contextual": 0.0}),
         ("divprune", {}), ("dart", {})]
FAMILIES = ("llava", "qwen2_5_vl")
STEPS = 6


def _samples(model_type: str) -> list:
    if model_type.startswith("qwen"):
        return [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    return [("what color is the circle?", [random_image(120, 90, 1)]),
            ("how many squares are there?", [random_image(64, 80, 2), random_image(90, 60, 3)])]


def _to(inputs: dict, device: str, dtype: torch.dtype) -> dict:
    return {k: v.to(device, dtype) if torch.is_floating_point(v) else v.to(device) for k, v in inputs.items()}


def _generate(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu()


def check(model_type: str, impl: str, device: str, dtype: torch.dtype) -> list[dict]:
    model, processor = tiny_model(model_type, impl, image_size=112)
    model = model.to(device, dtype)
    samples = _samples(model_type)
    batch = _to(tiny_inputs(processor, model_type, samples), device, dtype)
    alone = [_to(tiny_inputs(processor, model_type, [s]), device, dtype) for s in samples]
    rows = []
    with torch.no_grad():
        plain = model(**batch).logits.float()
    for method, options in CASES:
        row = {"family": model_type, "attn": impl, "dtype": str(dtype).replace("torch.", ""), "method": method,
               **{k: str(v) for k, v in options.items()}}
        try:
            with torch.no_grad(), vtprune.apply(model, method, keep=1.0, **options):
                identity = model(**batch).logits.float()
            valid = batch["attention_mask"].bool()
            row["keep1_max_abs"] = float((identity - plain)[valid].abs().max())
            with vtprune.apply(model, method, keep=0.4, **options) as handle:
                tokens, logits = _generate(model, batch)
                kept = handle.last_stats.kept_indices
                stages = [s.layer for s in handle.stages]
                diffs, same = [], True
                for index, inputs in enumerate(alone):
                    alone_tokens, alone_logits = _generate(model, inputs)
                    same &= bool(torch.equal(alone_tokens[0], tokens[index]))
                    diffs.append(float((alone_logits[0] - logits[index]).abs().max()))
            row["batch_tokens_equal"], row["batch_max_abs"] = same, max(diffs)
            row.update(_reference(model, alone, stages, kept, tokens, logits))
            row["ok"] = True
        except Exception as error:  # noqa: BLE001 - every failure is reported in the results
            row["ok"], row["error"] = False, f"{type(error).__name__}: {error}"[:300]
        rows.append(row)
    return rows


def _reference(model, alone, stages, kept, tokens, logits) -> dict:
    """The independent reference runs its layers with SDPA (it builds a 4-D mask)."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        same, diffs = True, []
        for index, inputs in enumerate(alone):
            inputs = {k: v.cpu() for k, v in inputs.items()}
            device = next(model.parameters()).device
            ref_tokens, ref_logits = _ref_on(model, inputs, device, stages, [s[index] for s in kept])
            same &= bool(torch.equal(ref_tokens, tokens[index]))
            diffs.append(float((ref_logits - logits[index]).abs().max()))
        return {"reference_tokens_equal": same, "reference_max_abs": max(diffs)}
    finally:
        model.set_attn_implementation(implementation)


def _ref_on(model, inputs, device, stages, kept):
    moved = _to(inputs, str(device), next(model.parameters()).dtype)
    tokens, logits = reference_decode(model, moved, stages, kept, STEPS, suppress=len(SPECIAL_TOKENS))
    return tokens.cpu(), logits.float().cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="runs/gpu-contract")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    impls = ["sdpa"] + (["flash_attention_2"] if gpu and importlib.util.find_spec("flash_attn") else [])
    start, rows = time.time(), []
    for model_type in FAMILIES:
        for impl in impls:
            rows += check(model_type, impl, args.device, dtype)
            print(f"[contract] {model_type} {impl}: {sum(r['ok'] for r in rows)}/{len(rows)} ran", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "contract.json").write_text(json.dumps(rows, indent=1))
    (out / "contract.md").write_text(_table(rows, args.device, time.time() - start))
    print(_table(rows, args.device, time.time() - start))
    return 0 if all(r["ok"] for r in rows) else 1


def _table(rows: list[dict], device: str, seconds: float) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"Engine contract on {name} ({seconds:.0f} s), torch {torch.__version__}. Max |Δ logit| and token "
             "equality: keep=1 vs unwrapped; batch of 2 (ragged, left-padded) vs alone; cached decoding vs "
             "the independent no-cache reference (run with SDPA).", "",
             "| family | attn | dtype | method | keep=1 | batch == alone | reference | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['family']} | {r['attn']} | {r['dtype']} | {r['method']} | | | | {r['error']} |")
            continue
        lines.append(f"| {r['family']} | {r['attn']} | {r['dtype']} | {r['method']} | {r['keep1_max_abs']:.2e} | "
                     f"{'same tokens' if r['batch_tokens_equal'] else 'TOKENS DIFFER'}, {r['batch_max_abs']:.2e} | "
                     f"{'same tokens' if r['reference_tokens_equal'] else 'TOKENS DIFFER'}, "
                     f"{r['reference_max_abs']:.2e} | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
