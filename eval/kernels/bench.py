"""Micro-benchmark of the vtprune kernels (segmented top-k, token merge, attention-received scores).

Usage::

    vtprune bench kernels [--device cuda|cpu] [--out runs/kernels] [--quick]

The default output is ``runs/kernels``; the committed run is refreshed with ``--out docs/results/kernels``.

Writes ``<out>/bench_kernels_<device>.csv``: one row per (kernel, impl, shape, batch, size, dtype, device) with
p20/p50/p80 latency in ms over warmed-up runs, the largest deviation from the torch implementation on the same
inputs (``max_abs_diff``; for top-k the number of differing indices), and the run conditions. On CUDA the timing
is ``triton.testing.do_bench`` (L2 flushed, synchronised); otherwise a ``time.perf_counter`` loop (synchronising
on CUDA). On CPU the Triton impl is skipped (the interpreter is not a speed measurement) and the rows say so.
Shapes follow LLaVA-1.5 (576 visual tokens, L=640), LLaVA-NeXT (2880, L=2950), video (32x196=6272, L=6350) and
Qwen2.5-VL high-res (16384, L=16450), batch 1 and 8. Impls measured through the public API (input validation
included), except ``torch_loop``: the per-sample Python-loop top-k baseline, called directly.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib.metadata
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from vtprune.kernels import (
    merge_tokens,
    segmented_topk,
    segmented_topk_torch_loop,
    triton_available,
    visual_attention_scores,
)

# name -> (visual tokens N, full key length L)
PRESETS: dict[str, dict[str, tuple[int, int]]] = {
    "full": {
        "llava-1.5": (576, 640),
        "llava-next": (2880, 2950),
        "video-32x196": (6272, 6350),
        "qwen2.5-vl-hires": (16384, 16450),
    },
    "tiny": {"tiny-a": (24, 40), "tiny-b": (50, 70)},
}
DIMS = {
    "full": {"hidden": 4096, "head_dim": 128, "heads": 32},
    "tiny": {"hidden": 32, "head_dim": 16, "heads": 4},
}
COLUMNS = [
    "kernel", "impl", "shape", "batch", "tokens", "size", "dtype", "device", "p20_ms", "p50_ms", "p80_ms",
    "reps", "max_abs_diff", "note", "device_name", "torch_version", "triton_version", "transformers_version",
    "git_sha", "timestamp",
]  # fmt: skip
CPU_NOTE = "triton skipped on cpu: the interpreter is not a speed measurement"


@dataclass(frozen=True)
class Case:
    """One benchmark configuration; ``make`` builds the inputs, ``impls`` maps impl name -> callable(inputs)."""

    kernel: str
    shape: str
    batch: int
    tokens: int
    size: str
    dtype: torch.dtype
    nbytes: int
    make: Callable[[torch.device], tuple]
    impls: dict[str, Callable[..., torch.Tensor]]


def _topk_cases(shape: str, n_vis: int, bsz: int) -> list[Case]:
    def make(dev: torch.device) -> tuple:
        g = torch.Generator().manual_seed(0)
        lengths = (n_vis - torch.arange(bsz) * (n_vis // 16)).clamp_min(1)  # ragged spans
        return (
            torch.rand(bsz, n_vis, generator=g).to(dev),
            lengths.to(dev),
            (lengths // 4).clamp_min(1).to(dev),
        )

    impls = {
        "torch_loop": segmented_topk_torch_loop,
        "torch": lambda s, n, k: segmented_topk(s, n, k, impl="torch"),
        "triton": lambda s, n, k: segmented_topk(s, n, k, impl="triton"),
    }
    size = f"N={n_vis} k=N/4"
    return [Case("topk", shape, bsz, n_vis, size, torch.float32, bsz * n_vis * 12, make, impls)]


def _merge_cases(shape: str, n_vis: int, bsz: int, hidden: int, dtype: torch.dtype) -> list[Case]:
    n_tgt = max(1, n_vis // 4)

    def make(dev: torch.device) -> tuple:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(bsz, n_vis, hidden, generator=g).to(dev, dtype)
        assign = torch.randint(-1, n_tgt, (bsz, n_vis), generator=g).to(dev)
        return x, assign, torch.rand(bsz, n_vis, generator=g).to(dev), n_tgt

    impls = {
        "torch": lambda x, a, w, t: merge_tokens(x, a, w, t, impl="torch"),
        "triton": lambda x, a, w, t: merge_tokens(x, a, w, t, impl="triton"),
    }
    nbytes = bsz * n_vis * hidden * (dtype.itemsize + 8)  # input + fp32 products/accumulators
    size = f"N={n_vis} T=N/4 D={hidden}"
    return [Case("merge", shape, bsz, n_vis, size, dtype, nbytes, make, impls)]


def _scoring_cases(shape: str, n_keys: int, bsz: int, dims: dict[str, int], dtype: torch.dtype) -> list[Case]:
    heads, head_dim = dims["heads"], dims["head_dim"]
    cases = []
    for kv_heads in sorted({heads // 4, heads}):
        for n_q in (1, 32):

            def make(dev: torch.device, kv_heads: int = kv_heads, n_q: int = n_q) -> tuple:
                g = torch.Generator().manual_seed(0)
                q = torch.randn(bsz, heads, n_q, head_dim, generator=g).to(dev, dtype)
                k = torch.randn(bsz, kv_heads, n_keys, head_dim, generator=g).to(dev, dtype)
                pos = (torch.arange(n_keys - n_q, n_keys)[None].repeat(bsz, 1)).to(dev)  # last text tokens
                return q, k, pos

            impls = {
                "torch": lambda q, k, p: visual_attention_scores(q, k, p, impl="torch"),
                "triton": lambda q, k, p: visual_attention_scores(q, k, p, impl="triton"),
            }
            chunk = min(
                bsz * heads * n_q * n_keys * 4 * 3, 3 * 256 * 2**20
            )  # reference holds <=256 MiB chunks
            nbytes = bsz * (heads * n_q + kv_heads * n_keys) * head_dim * dtype.itemsize + chunk
            size = f"L={n_keys} H={heads} Hkv={kv_heads} Q={n_q} d={head_dim}"
            cases.append(Case("scoring", shape, bsz, n_keys, size, dtype, nbytes, make, impls))
    return cases


def build_cases(preset: str, kernels: list[str], batches: list[int], device: torch.device) -> list[Case]:
    """All cases of ``preset`` for ``kernels`` and ``batches`` (bf16 merge/scoring on CUDA, fp32 on CPU)."""
    dims = DIMS[preset]
    act_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases: list[Case] = []
    for shape, (n_vis, n_keys) in PRESETS[preset].items():
        for bsz in batches:
            if "topk" in kernels:
                cases += _topk_cases(shape, n_vis, bsz)
            if "merge" in kernels:
                cases += _merge_cases(shape, n_vis, bsz, dims["hidden"], act_dtype)
            if "scoring" in kernels:
                cases += _scoring_cases(shape, n_keys, bsz, dims, act_dtype)
    return cases


def time_ms(
    fn: Callable[[], object], device: torch.device, warmup: int, reps: int
) -> tuple[float, float, float]:
    """p20/p50/p80 of ``fn()`` in milliseconds (``do_bench`` on CUDA with triton, else a perf_counter loop)."""
    if device.type == "cuda" and triton_available():
        import triton.testing

        res = triton.testing.do_bench(fn, warmup=warmup, rep=reps, quantiles=[0.2, 0.5, 0.8])
        return float(res[0]), float(res[1]), float(res[2])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    p20, p50, p80 = np.percentile(times, [20, 50, 80])
    return float(p20), float(p50), float(p80)


def _max_abs_diff(kernel: str, out: torch.Tensor, ref: torch.Tensor) -> float:
    if kernel == "topk":
        return float((out != ref).sum())
    return float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0


def run_conditions(device: torch.device) -> dict[str, str]:
    """Device name, library versions, git SHA and a UTC timestamp."""

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "none"

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True
        )
        git_sha = sha.stdout.strip() if sha.returncode == 0 and sha.stdout.strip() else "unknown"
    except OSError:
        git_sha = "unknown"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "device_name": name,
        "torch_version": torch.__version__,
        "triton_version": version("triton"),
        "transformers_version": version("transformers"),
        "git_sha": git_sha,
        "timestamp": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def bench_case(case: Case, device: torch.device, warmup: int, reps: int) -> list[dict[str, object]]:
    """Rows for every runnable impl of ``case`` (Triton only on CUDA with triton installed)."""
    inputs = case.make(device)
    ref = case.impls["torch"](*inputs)
    rows = []
    for impl, fn in case.impls.items():
        note = ""
        if impl == "triton":
            if device.type != "cuda" or not triton_available():
                continue
        elif device.type == "cpu":
            note = CPU_NOTE
        out = fn(*inputs)
        p20, p50, p80 = time_ms(lambda fn=fn: fn(*inputs), device, warmup, reps)
        rows.append(
            {
                "kernel": case.kernel, "impl": impl, "shape": case.shape, "batch": case.batch,
                "tokens": case.tokens, "size": case.size, "dtype": str(case.dtype).removeprefix("torch."),
                "device": device.type, "p20_ms": f"{p20:.5f}", "p50_ms": f"{p50:.5f}", "p80_ms": f"{p80:.5f}",
                "reps": reps, "max_abs_diff": f"{_max_abs_diff(case.kernel, out, ref):.3g}", "note": note,
            }
        )  # fmt: skip
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options; a bad value is one ``error:`` line and exit status 2, before any kernel runs."""
    from vtprune.cli.checks import OneLineParser, check_output_dir, int_range, number_range
    from vtprune.cli.outputs import add_force_argument, check_new_results

    p = OneLineParser(prog="vtprune bench kernels", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--out", type=Path, default=Path("runs/kernels"),
                   help="output folder (default: runs/kernels; the committed run lives in docs/results/kernels)")
    add_force_argument(p)
    p.add_argument("--quick", action="store_true", help="few repeats (CI smoke run)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full", help="'tiny' = toy shapes for tests")
    p.add_argument(
        "--kernels", nargs="+", choices=["topk", "merge", "scoring"], default=["topk", "merge", "scoring"]
    )
    p.add_argument("--batch", type=int_range(1, 4096), nargs="+", default=[1, 8], help="batch sizes, each >= 1")
    p.add_argument("--threads", type=int_range(1, 1024), default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-gib", type=number_range(0.0, above=True), default=8.0,
                   help="skip cases estimated to need more memory (GiB, > 0)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda, but torch sees no GPU; use --device cpu")
    try:
        check_output_dir(args.out)
        check_new_results(args.out, (f"bench_kernels_{args.device}.csv",), args.force)
    except ValueError as error:
        p.error(str(error))
    return args


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; return the CSV path."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warmup, reps = (2, 5) if args.quick else (10, 50)
    if device.type == "cuda" and triton_available():
        warmup, reps = (5, 25) if args.quick else (25, 200)  # do_bench: milliseconds, not counts
    cond = run_conditions(device)
    cases = build_cases(args.preset, args.kernels, args.batch, device)
    rows: list[dict[str, object]] = []
    for case in tqdm(cases, desc=f"bench_kernels[{device.type}]", unit="case"):
        if case.nbytes > args.max_gib * 2**30:
            tqdm.write(
                f"skip {case.kernel} {case.shape} B={case.batch} {case.size}: > --max-gib {args.max_gib}"
            )
            continue
        rows += [{**row, **cond} for row in bench_case(case, device, warmup, reps)]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_kernels_{device.type}.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(summary(rows))
    print(f"wrote {len(rows)} rows to {path} (every column: p20/p50/p80, reps, conditions); plots: "
          f"vtprune bench plot-kernels --out {args.out}")
    return path


def summary(rows: list[dict[str, object]]) -> str:
    """A Markdown table of the p50 latency: one line per kernel x shape x batch, one column per impl.

    ``max |diff|`` is the largest deviation of any impl from the torch twin on the same inputs (top-k: the
    number of differing indices).
    """
    impls = list(dict.fromkeys(str(r["impl"]) for r in rows))
    lines = ["| kernel | shape | batch | size | " + " | ".join(f"{i} p50 ms" for i in impls) + " | max abs diff |",
             "|---|---|---|---|" + "---|" * (len(impls) + 1)]
    groups: dict[tuple, dict[str, dict[str, object]]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["shape"], r["batch"], r["size"]), {})[str(r["impl"])] = r
    for (kernel, shape, batch, size), by_impl in groups.items():
        cells = [f"{float(by_impl[i]['p50_ms']):.4g}" if i in by_impl else "–" for i in impls]
        diff = max(float(r["max_abs_diff"]) for r in by_impl.values())
        lines.append(f"| {kernel} | {shape} | {batch} | {size} | " + " | ".join(cells) + f" | {diff:.3g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
