"""The layer-wise vLLM plugin on a device's attention backends, against vtprune's transformers path.

For each backend (GPU: FLASH_ATTN, FLASHINFER where importable; CPU: CPU_ATTN) and each method (fastv, pdrop, dart,
prefixkv: each layer's kept entries; ``fastv@1``: FastV at layer 1, whose pruned region's 3 layers are 3 KV cache
groups of one spec, which FlashAttention builds once and updates for the others) on the embedded LLaVA: one vLLM engine (prefix caching, chunked prefill in chunks of 8 tokens, two sequences at a
time) answers four prompts at keep 0.25 for 6 steps; the kept tokens, the token ids and the largest log-probability
gap against ``vtprune.wrap`` on the same weights and dtype go to ``OUT/layerwise.json`` and ``OUT/layerwise.md``.
A backend that refuses the model (e.g. its head size) is recorded and skipped. Each engine runs twice (``--modes``):
``eager`` (``enforce_eager=True``) and ``graphs`` (vLLM's defaults, as the plugin adjusts them: every method compiled,
CUDA graphs for uniform decode steps), with the compilation and CUDA-graph modes
the engine ran and the seconds its ``generate`` call took; a ``stock`` row per backend (stock vLLM at its defaults,
unpruned) gives the time to compare with. Run by ``scripts/gpu_check.sh`` on a GPU; ``--device cpu``
runs the CPU backend (a check of the script itself).

usage: python scripts/gpu_vllm_layerwise.py --device cuda|cpu --out DIR [--force] [--backends A,B] [--methods M,N] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

STEPS = 6


def prompts(count: int = 4) -> list:
    from vtprune.shapes.task import make_split

    items = [(s.image, s.questions[0].text) for s in make_split("test", count + 1)]
    return items[:count - 1] + [([items[count - 1][0], items[count][0]], items[count - 1][1])]


def chat(template_owner, question: str, images: int) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": question}]}]
    return template_owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def split(method: str) -> tuple[str, dict]:
    """``"fastv@1"`` -> ``("fastv", {"layer": 1})``; a plain name has no options."""
    name, _, layer = method.partition("@")
    return name, ({"layer": int(layer)} if layer else {})


def reference(folder: str, method: str, dtype, device: str, items: list) -> list:
    """(token ids, kept visual tokens, per-step log-probabilities) of vtprune's transformers path."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vtprune

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype).to(device).eval()
    processor = AutoProcessor.from_pretrained(folder)
    method, options = split(method)
    handle = vtprune.wrap(model, method, keep=0.25, **options)
    out = []
    try:
        for image, question in items:
            count = len(image) if isinstance(image, list) else 1
            inputs = processor(images=image, text=chat(processor, question, count), return_tensors="pt").to(device)
            with torch.no_grad():
                result = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, eos_token_id=[10 ** 9], pad_token_id=0)
            ids = result.sequences[0, inputs["input_ids"].shape[1]:].tolist()
            steps = [torch.log_softmax(s[0].float(), dim=-1).cpu() for s in result.scores]
            layers = [[int(i) for i in layer[0]] for layer in handle.last_stats.kept_indices]
            out.append((ids, layers if method == "prefixkv" else layers[-1], steps))
    finally:
        handle.remove()
    return out


def engine_run(folder: str, method: str, dtype: str, backend: str, items: list,
               eager: bool) -> tuple[list, list, dict]:
    from vllm import LLM, SamplingParams

    from vtprune.vllm.common import clear_selections, recent_selections

    name, options = split(method)
    overrides = None if method == "stock" else {"architectures": ["VtpruneLlavaForConditionalGeneration"],
                                                 "vtprune": {"method": name, "keep": 0.25, **options}}
    llm = LLM(folder, dtype=dtype, max_model_len=512, seed=0, enforce_eager=eager, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=2, attention_backend=backend,
              limit_mm_per_prompt={"image": 2}, gpu_memory_utilization=0.3, hf_overrides=overrides)
    try:
        llm.apply_model(clear_selections)
        requests = [{"prompt": chat(llm.get_tokenizer(), q, len(i) if isinstance(i, list) else 1),
                     "multi_modal_data": {"image": i}} for i, q in items]
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=5, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        compilation = llm.llm_engine.vllm_config.compilation_config
        ran = {"seconds": round(time.perf_counter() - started, 3),
               "compile": getattr(compilation.mode, "name", str(compilation.mode)),
               "cudagraphs": getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))}
        kept = llm.apply_model(recent_selections)[0] if overrides else []
        rows = [(list(o.outputs[0].token_ids), [{t: p.logprob for t, p in top.items()} for top in o.outputs[0].logprobs])
                for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows, kept, ran


def compare(rows: list, kept: list, ran: dict, want: list) -> dict:
    ids_equal = sum(ids == w[0] for (ids, _), w in zip(rows, want))
    gap = max((abs(v - float(w[2][step][t])) for (ids, tops), w in zip(rows, want) if ids == w[0]
               for step, top in enumerate(tops) for t, v in top.items()), default=float("nan"))
    return {"requests": len(rows), "ids_equal": ids_equal, "max_logprob_gap": round(gap, 5),
            "kept_equal": sorted(map(str, kept)) == sorted(str(w[1]) for w in want), **ran}


def write(out: Path, results: list[dict]) -> None:
    """``OUT/layerwise.json`` and ``OUT/layerwise.md`` of the rows so far."""
    (out / "layerwise.json").write_text(json.dumps(results, indent=2) + "\n")
    fields = ["method", "backend", "mode", "dtype", "requests", "ids_equal", "kept_equal", "max_logprob_gap", "compile",
              "cudagraphs", "seconds", "error"]
    lines = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    lines += ["| " + " | ".join(str(r.get(f, "")) for f in fields) + " |" for r in results]
    (out / "layerwise.md").write_text("# Layer-wise methods in vLLM on this device's attention backends\n\n"
                                      + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true", help="replace the layerwise.json an earlier run left in --out")
    parser.add_argument("--backends", default=None, help="default: FLASH_ATTN,FLASHINFER on cuda, CPU_ATTN on cpu")
    parser.add_argument("--methods", default="fastv,fastv@1,pdrop,dart,prefixkv",
                        help="method names; name@K: a layer-wise method's stage layer K")
    parser.add_argument("--modes", default="eager,graphs", help="eager (enforce_eager), graphs (vLLM's defaults)")
    args = parser.parse_args(argv)
    for method in args.methods.split(","):
        name, _, layer = method.partition("@")
        if not name or (layer and not layer.isdigit()):
            parser.error(f"--methods: {method!r} is not a method name or name@K with a layer number K (e.g. fastv@1)")
    if (Path(args.out) / "layerwise.json").exists() and not args.force:
        parser.error(f"--out {args.out}: it holds an earlier run's layerwise.json; pass --force to replace it, "
                     "or another folder")
    import torch

    from vtprune.vllm.export import model_folder

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the plugin's layer-wise methods run on
    backends = (args.backends or ("FLASH_ATTN,FLASHINFER" if args.device == "cuda" else "CPU_ATTN")).split(",")
    dtype = "float16" if args.device == "cuda" else "float32"
    folder, items = model_folder("embedded:llava"), prompts()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # most telling first (a time limit may stop the run; each row is written as it ends): stock vLLM at its defaults,
    # then each method at vLLM's defaults (graphs), then eager
    modes = [m for m in ("graphs", "eager") if m in args.modes.split(",")]
    jobs = [("stock", b, "graphs") for b in backends] + [(m, b, mode) for mode in modes
                                                         for m in args.methods.split(",") for b in backends]
    results, wanted = [], {}
    for method, backend, mode in jobs:
        row = {"method": method, "backend": backend, "mode": mode, "dtype": dtype}
        try:
            if method == "stock":
                rows, _, ran = engine_run(folder, "stock", dtype, backend, items, False)
                row.update({"requests": len(rows), **ran})
            else:
                if method not in wanted:
                    wanted[method] = reference(folder, method, getattr(torch, dtype), args.device, items)
                row.update(compare(*engine_run(folder, method, dtype, backend, items, mode == "eager"),
                                   wanted[method]))
        except Exception as error:  # noqa: BLE001 - a backend that refuses is recorded, the others still run
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        results.append(row)
        write(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
