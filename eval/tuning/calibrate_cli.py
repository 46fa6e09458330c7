"""``vtprune calibrate``: fit a model's positional attention trend for attention debiasing, or (``--method
prefixkv``) its PrefixKV profile of per-layer KV eviction ratios.

Examples::

    vtprune calibrate --model embedded:llava --method fastv --out vtprune/models/vtprune-llava-shapes/calibration.json --force
    vtprune calibrate --model embedded:llava --method prefixkv --out runs/prefixkv.json   # then profile=FILE

A file named ``calibration.json`` next to a model's ``config.json`` is what ``debias=True`` loads; any
other path is used with ``debias=PATH`` (``--method fastv+debias`` plus ``debias=PATH`` in Python). An existing
``--out`` file (or its plot) is replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vtprune.cli.checks import ATTN_IMPLEMENTATIONS, DTYPE_NAMES, check_output_file, int_range
from vtprune.cli.outputs import check_new_file
from vtprune.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="fit the positional attention trend used by debias")
    parser.add_argument("--model", default=None, help="folder / hub id, 'embedded:llava' (default), 'tiny:<type>'")
    parser.add_argument("--data", default=None,
                        help="folder of images (+ optional questions.jsonl); default: the vtprune-shapes calib split")
    parser.add_argument("--n", type=int_range(1, 1_000_000), default=256, help="number of calibration prompts (default 256)")
    long = parser.add_mutually_exclusive_group()
    long.add_argument("--video", action="store_true",
                      help="long prompts: all frames of calib-split clips (16-32 frames), open-ended questions")
    long.add_argument("--images-per-prompt", type=int_range(1, 64), default=None,
                      help="long prompts: this many calib-split images per prompt, the target in one of them")
    parser.add_argument("--frames", type=int_range(2, 256), default=None,
                        help="with --video: clips of exactly this many frames (default: the split's 16-32)")
    parser.add_argument("--method", default="fastv",
                        help="host whose attention is fitted: fastv, pdrop, transprune; or prefixkv (a KV profile)")
    parser.add_argument("--scope", default="visual", choices=("visual", "prompt"),
                        help="prefixkv: which tokens may leave the cache (default visual)")
    parser.add_argument("--layer", type=int_range(1), action="append", default=None,
                        help="host pruning layer K (repeatable; default: the host's default stage layers)")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=16, help="prompts per forward pass")
    parser.add_argument("--bins", type=int_range(1, 10_000), default=32, help="bins of the stored mean curve")
    parser.add_argument("--out", required=True,
                        help="output JSON (use it with --debias FILE); a PNG plot is written next to it. Named "
                             "calibration.json inside a model folder, debias=true picks it up")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file and its plot "
                        "(default: refuse)")
    parser.add_argument("--attn", default="sdpa", choices=ATTN_IMPLEMENTATIONS, help="attn_implementation")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.set_defaults(func=command_calibrate)


def command_calibrate(args: argparse.Namespace) -> int:
    from vtprune.eval.tuning.calibrate import HOST_QUERIES, calibrate, calibration_items, plot

    from vtprune.models.loading import check_load, load, model_label

    method = args.method.split("+")[0]
    if method not in (*HOST_QUERIES, "prefixkv"):
        raise UserError(f"--method {args.method!r}: calibration covers the attention hosts {', '.join(HOST_QUERIES)} "
                        "and prefixkv.")
    out = check_output_file(args.out)
    if out.suffix.lower() == ".png":
        raise UserError(f"--out {args.out!r}: the plot is written next to the JSON as .png; give a .json path.")
    check_output_file(out.with_suffix(".png"), "--out (its PNG plot)")
    check_new_file(out, args.force)
    check_new_file(out.with_suffix(".png"), args.force, "--out's plot")
    check_load(args.model, args.device, args.attn, args.dtype)
    if (args.video or args.images_per_prompt) and args.data is not None:
        raise UserError("--video / --images-per-prompt generate their prompts; they do not take --data.")
    if args.video or args.images_per_prompt:
        from vtprune.eval.accuracy.long_items import calibration_prompts

        items = calibration_prompts(args.n, args.video, args.images_per_prompt or 0, args.frames)
    else:
        from vtprune.models.embedded import task_of

        # reads the images now: a bad file fails before the model loads
        items = calibration_items(args.data, args.n, task_of(args.model))
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    if method == "prefixkv":
        return _write_profile(args, out, model, processor, items)
    result = calibrate(model, processor, items, method, args.layer, args.batch_size, args.bins,
                       model_name=model_label(args.model))
    if args.video or args.images_per_prompt:
        result["data"] = (f"calib clips, all {args.frames or '16-32'} frames" if args.video
                          else f"calib sets of {args.images_per_prompt} images")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    image = plot(result, out.with_suffix(".png"))
    for key, entry in result["layers"].items():
        print(f"score layer {key}: sigma {entry['sigma']:.3f}  mu {entry['mu']:.3f}  r2 {entry['r2']:.3f}  "
              f"({entry['n_pairs']} pairs)")
    print(f"wrote {out}" + (f" and {image}" if image else " (no plot: matplotlib is not installed)"))
    return 0


def _write_profile(args: argparse.Namespace, out: Any, model: Any, processor: Any, items: list) -> int:
    from vtprune.eval.tuning.calibrate_kv import (
        profile,  # the PrefixKV side (loaded only for --method prefixkv)
    )

    from vtprune.models.loading import model_label

    result = profile(model, processor, items, scope=args.scope, batch_size=args.batch_size,
                     model_name=model_label(args.model))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for budget, ratios in result["budgets"].items():
        print(f"keep {budget}: evicted per layer {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"wrote {out} ({result['n_samples']} prompts); use it with --method prefixkv --keep K "
          f"and profile={out} (scope={args.scope})")
    return 0
