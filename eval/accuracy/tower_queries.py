"""VisionZip on large Qwen-VL towers: the exact mean over all queries of the attention received vs cheaper maps.

``vtprune bench tower-queries --out docs/results/visionzip-queries`` scores one image of
``--side`` x ``--side`` patches (default 96 x 96 = 9,216 patches, 2,304 merged tokens: a 1344 px image on
Qwen2-VL) at one full-attention ViT block, four ways:

* ``all``: every query (``queries="all"``, the exact map VisionZip ranks by; what ``"auto"`` does up to
  6,144 patches);
* ``sampled N``: the mean row of ``N`` evenly spaced queries (``queries=N``; ``"auto"`` above 6,144 patches
  uses 1,024);
* ``averaged``: one query per head, the mean of all queries (AngelSlim's large-tower shortcut; not offered as
  an option, measured for comparison).

Towers: ``random``: a randomly initialised Qwen2-VL-7B vision block (embed 1280, 16 heads of 80, seed 0) on
random pixels; ``embedded``: the trained embedded Qwen2-VL tower (4 heads of 32, last block) on a shapes test
image resized to the same grid (outside its 224 px training size). Per map: time of the scoring alone (q/k
given; median of ``--repeats``), and against the exact map on merged tokens (sum of each 2 x 2 unit, as
VisionZip ranks them): overlap of the top-``keep`` sets (keep 0.25: 576 of 2,304) and Spearman's rho. Writes
``queries.csv`` and ``queries.md`` with the run conditions.
"""

from __future__ import annotations

import argparse
import csv
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from vtprune.methods.tower import merge_units, qwen_block_qk, received_attention

SAMPLES = (256, 512, 1024, 2048)


def averaged_query(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n]`` attention from one averaged query per head (``query``, ``key``: ``[H, n, d]``), head mean."""
    mean = query.float().mean(dim=1, keepdim=True)
    return torch.softmax(mean @ key.float().transpose(-1, -2) * scale, dim=-1).mean(dim=0)[0]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho of two ``[n]`` vectors (ranks by stable sort; ties are negligible on float maps)."""
    ranks = [torch.empty_like(v, dtype=torch.float64).scatter_(0, v.argsort(stable=True),
                                                               torch.arange(v.numel(), dtype=torch.float64))
             for v in (a, b)]
    x, y = (r - r.mean() for r in ranks)
    return float((x * y).sum() / (x.norm() * y.norm()))


def overlap(a: torch.Tensor, b: torch.Tensor, keep: float) -> float:
    """Share of the top ``keep`` of ``a`` that is also in the top ``keep`` of ``b``."""
    k = max(1, int(keep * a.numel() + 0.5))
    top_a, top_b = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return len(top_a & top_b) / k


def random_block_qk(side: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q, k ``[H, n, d]`` and scale of a random Qwen2-VL-7B-size vision block on random pixels (n = side^2)."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(seed)
    config = Qwen2VLVisionConfig(depth=1, embed_dim=1280, num_heads=16, hidden_size=3584, mlp_ratio=4)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    grid = torch.tensor([[1, side, side]])
    pixels = torch.randn(side * side, 3 * 2 * 14 * 14)
    return _block_qk(tower, tower.blocks[-1], pixels, grid)


def embedded_block_qk(side: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q, k and scale of the embedded Qwen2-VL tower's last block on a shapes test image of side^2 patches."""
    from vtprune.models.loading import load
    from vtprune.shapes.task import make_split

    model, processor = load("embedded:qwen2_vl", device="cpu")
    image = make_split("test", 1)[0].image.resize((side * 14, side * 14))
    area = (side * 14) ** 2
    pixels = processor.image_processor(images=[image], return_tensors="pt",
                                       size={"shortest_edge": area, "longest_edge": area})
    tower = model.model.visual
    return _block_qk(tower, tower.blocks[-1], pixels["pixel_values"], pixels["image_grid_thw"])


def _block_qk(tower: Any, block: Any, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    seen = {}

    def grab(module: Any, args: tuple, kwargs: dict) -> None:
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["rope"] = kwargs["position_embeddings"]

    hook = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            tower(pixels, grid_thw=grid)
    finally:
        hook.remove()
    with torch.no_grad():
        query, key = qwen_block_qk(block, seen["hidden"], *seen["rope"])
    return query.transpose(0, 1).contiguous(), key.transpose(0, 1).contiguous(), float(block.attn.scaling)


def timed(fn, repeats: int) -> tuple[torch.Tensor, float]:
    """``fn()``'s result and its median wall time in ms over ``repeats`` runs."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return result, sorted(times)[len(times) // 2]


def measure(tower: str, query: torch.Tensor, key: torch.Tensor, scale: float, keep: float, repeats: int) -> list[dict]:
    """One row per map: time, overlap of the top ``keep`` merged tokens with the exact map, Spearman."""
    n = query.shape[1]
    zero = torch.zeros(n, key.shape[-1])

    def merged(values: torch.Tensor) -> torch.Tensor:
        return merge_units(values, zero, 4, None)[0]

    variants = [("all", lambda: received_attention(query, key, scale))]
    variants += [(f"sampled {m}", lambda m=m: received_attention(query, key, scale, rows=m)) for m in SAMPLES]
    variants += [("averaged", lambda: averaged_query(query, key, scale))]
    rows, exact = [], None
    with torch.no_grad():
        for name, fn in variants:
            values, ms = timed(fn, repeats)
            values = merged(values)
            exact = values if exact is None else exact
            rows.append({"tower": tower, "patches": n, "heads": query.shape[0], "map": name, "ms": round(ms, 1),
                         "top_overlap": round(overlap(exact, values, keep), 4),
                         "spearman": round(spearman(exact, values), 4)})
    return rows


def write(rows: list[dict], out: Path, conditions: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "queries.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["# VisionZip scoring on a large Qwen-VL tower: exact vs sampled / averaged queries", "",
             "Conditions: " + ", ".join(f"{k} {v}" for k, v in conditions.items()) + ".", "",
             "One image of 96 x 96 patches (9,216; 2,304 merged tokens after the 2 x 2 merger) scored at one "
             "full-attention ViT block; `ms` is the scoring alone (q/k given). `random`: a randomly initialised "
             "Qwen2-VL-7B-size vision block (embed 1280, 16 heads of 80, seed 0) on random pixels, whose map is "
             "nearly flat (a hard case for any shortcut); `embedded`: the trained embedded Qwen2-VL tower (4 heads "
             "of 32, last block) on a shapes test image resized to the same grid. `sampled N`: the mean row of N "
             "evenly spaced queries (`visionzip` option `queries=N`; `queries=\"auto\"` uses 1,024 above 6,144 "
             "patches); `averaged`: one mean query per head (AngelSlim's shortcut, for comparison). Overlap: share "
             "of the exact map's top 25 % merged tokens (576) also in the variant's top 25 %. Times are medians "
             "on a CPU shared with other jobs: compare ratios, not absolute values.", "",
             "| tower | patches | heads | map | ms | top-25% overlap with `all` | Spearman with `all` |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['tower']} | {r['patches']} | {r['heads']} | {r['map']} | {r['ms']} | {r['top_overlap']:.3f} | "
              f"{r['spearman']:.3f} |" for r in rows]
    (out / "queries.md").write_text("\n".join(lines) + "\n")


TOWERS = ("random", "embedded")


def tower_list(text: str) -> list[str]:
    """argparse type: comma-separated towers, each one of :data:`TOWERS`."""
    from vtprune.cli.checks import name_list

    towers = name_list(text).split(",")
    for tower in towers:
        if tower not in TOWERS:
            raise argparse.ArgumentTypeError(f"unknown tower {tower!r}; choose from {', '.join(TOWERS)}")
    return towers


def main(argv: list[str] | None = None) -> int:
    from vtprune.cli.checks import OneLineParser, check_output_dir, int_range
    from vtprune.cli.outputs import add_force_argument, check_new_results

    parser = OneLineParser(prog="vtprune bench tower-queries", description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int_range(2, 128), default=96, help="patches per side (even; default 96)")
    parser.add_argument("--repeats", type=int_range(1, 20), default=3)
    parser.add_argument("--threads", type=int_range(1, 256), default=1)
    parser.add_argument("--towers", type=tower_list, default="random,embedded",
                        help=f"comma-separated, of {', '.join(TOWERS)} (default: both)")
    parser.add_argument("--out", required=True, help="output folder (queries.csv, queries.md)")
    add_force_argument(parser)
    args = parser.parse_args(argv)
    if args.side % 2:
        parser.error(f"argument --side: must be even (2 x 2 merge units), got {args.side}")
    try:
        out = check_new_results(check_output_dir(args.out), ("queries.csv", "queries.md"), args.force)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    rows = []
    for tower in args.towers:
        query, key, scale = random_block_qk(args.side) if tower == "random" else embedded_block_qk(args.side)
        rows += measure(tower, query, key, scale, 0.25, args.repeats)
        print(*(f"{r['tower']:>8} {r['map']:>12} {r['ms']:>9.1f} ms  overlap {r['top_overlap']:.3f}  "
                f"rho {r['spearman']:.3f}" for r in rows[-6:]), sep="\n")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    conditions = {"device": f"CPU ({platform.processor() or platform.machine()})", "threads": args.threads,
                  "dtype": "float32", "torch": torch.__version__, "keep": 0.25, "repeats (median)": args.repeats,
                  "git": sha or "unknown"}
    write(rows, out, conditions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
