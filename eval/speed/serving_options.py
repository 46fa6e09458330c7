"""The options of ``vtprune bench serving``, checked before vLLM starts (one ``error:`` line, exit status 2).

A rerun over the ``serving.csv`` of an earlier run is refused unless ``--force``; ``--plot-only`` redraws the
plot of a results folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: the random-weight proxies of vtprune.eval.speed.serving
PROXIES = ("proxy576x32", "proxy576", "proxy7b", "proxy7bx4")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The run's options; a bad value is one ``error:`` line and exit status 2, before vLLM starts."""
    from vtprune.cli.checks import OneLineParser, int_range

    parser = OneLineParser(prog="vtprune bench serving",
                           description="Serving benchmark: vLLM with vtprune's plugin, pruned vs unpruned, as users "
                                       "measure serving (and vs vtprune's transformers path).")
    parser.add_argument("--models", default="proxy576x32",
                        help="proxy576x32 (32 layers, the default), proxy576 (4 layers: quick), proxy7b (GPU), "
                             "proxy7bx4 (four of LLaVA-1.5-7B's layers: 7B layer geometry on a CPU), "
                             "embedded:llava or a model folder, comma-separated")
    parser.add_argument("--methods", default="divprune,fastv,pdrop",
                        help="the pruned engines' methods, comma-separated: pre-LLM (divprune, random) and layer-wise "
                             "(fastv, pdrop, transprune, ttv, dart)")
    parser.add_argument("--method", default=None, help="one method (the same as --methods METHOD)")
    parser.add_argument("--keep", type=float, default=0.25, help="keep fraction of the pruned rows")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int_range(1), default=32,
                        help="requests per level (at least 2 x the level are sent)")
    parser.add_argument("--max-tokens", type=int_range(1), default=8, help="output tokens per request")
    parser.add_argument("--transformers-requests", type=int_range(0), default=8,
                        help="0: skip vtprune's transformers path")
    parser.add_argument("--rounds", type=int_range(1, 100), default=3, help="alternating rounds per level (median reported)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="float32 on a CPU, bfloat16 on a GPU")
    parser.add_argument("--max-model-len", type=int_range(64), default=1024, help="vLLM's max_model_len")
    parser.add_argument("--block-size", type=int_range(1), default=16,
                        help="KV block size the memory columns count in (vLLM's default on a GPU is 16)")
    parser.add_argument("--kv-budget-gib", type=float, default=8.0,
                        help="KV budget for the max_requests_in_budget column, GiB")
    parser.add_argument("--memory-bound", type=int_range(0), default=None,
                        help="also run the highest concurrency with a KV cache that holds this many unpruned requests "
                             "(fewer than the concurrency; default: a quarter of it); 0: skip")
    parser.add_argument("--out", default="docs/results/serving", help="folder for CSV, Markdown and plot")
    parser.add_argument("--force", action="store_true",
                        help="replace the serving.csv an earlier run left in --out (default: refuse)")
    parser.add_argument("--plot-only", default=None, help="only redraw the plot of this results folder")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error).removeprefix("vtprune: "))
    return args


def check_args(args: argparse.Namespace) -> None:
    """Levels, method, keep, models and the output folder (``ValueError`` naming the value); sets the levels."""
    from vtprune.cli.checks import check_output_dir
    from vtprune.cli.outputs import check_new_results
    from vtprune.vllm.settings import check_keep, check_method

    if args.plot_only is not None:
        if not (Path(args.plot_only) / "serving.csv").is_file():
            raise ValueError(f"--plot-only {args.plot_only!r} holds no serving.csv; give a folder a serving run wrote.")
        return
    text = args.concurrency
    try:
        args.concurrency = [int(level) for level in text.split(",") if level.strip()]
    except ValueError:
        args.concurrency = []
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError(f"--concurrency {text!r}: give comma-separated levels >= 1, e.g. 1,8,32.")
    args.methods = [args.method] if args.method is not None else [m for m in args.methods.split(",") if m.strip()]
    if not args.methods:
        raise ValueError("--methods '': give one or more methods, e.g. --methods divprune,fastv.")
    for method in args.methods:
        check_method(method)
    check_keep(args.keep, "--keep")
    if args.memory_bound is None:
        args.memory_bound = max(args.concurrency) // 4
    if args.memory_bound and args.memory_bound >= max(args.concurrency):
        raise ValueError(f"--memory-bound {args.memory_bound}: the KV budget must hold fewer unpruned requests than "
                         f"the highest --concurrency ({max(args.concurrency)}); give a smaller number, or 0 to skip.")
    if not args.kv_budget_gib > 0:
        raise ValueError(f"--kv-budget-gib {args.kv_budget_gib}: give a positive number of GiB, e.g. 8.")
    for model in args.models.split(","):
        if model not in PROXIES and not model.startswith("embedded:") and not (Path(model) / "config.json").is_file():
            raise ValueError(f"--models: {model!r} is neither {', '.join(PROXIES)}, an embedded:NAME model nor a model "
                             "folder; e.g. --models proxy576,embedded:llava.")
    check_new_results(check_output_dir(args.out), ("serving.csv",), args.force)
