"""``vtprune calibrate``: fit a model's positional attention trend for attention debiasing.

Example::

    vtprune calibrate --model embedded:llava --method fastv --out vtprune/models/vtprune-llava-shapes/calibration.json

A file named ``calibration.json`` next to a model's ``config.json`` is what ``debias=True`` loads; any
other path is used with ``debias=PATH`` (``--method fastv+debias`` plus ``debias=PATH`` in Python).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="fit the positional attention trend used by debias")
    parser.add_argument("--model", default=None, help="folder / hub id, 'embedded:llava' (default), 'tiny:<type>'")
    parser.add_argument("--data", default=None,
                        help="folder of images (+ optional questions.jsonl); default: the vtprune-shapes calib split")
    parser.add_argument("--n", type=int, default=256, help="number of calibration prompts (default 256)")
    parser.add_argument("--method", default="fastv", help="host whose attention is fitted: fastv, pdrop, transprune")
    parser.add_argument("--layer", type=int, action="append", default=None,
                        help="host pruning layer K (repeatable; default: the host's default stage layers)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bins", type=int, default=32, help="bins of the stored mean curve")
    parser.add_argument("--out", required=True, help="output JSON; a PNG plot is written next to it")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.set_defaults(func=command_calibrate)


def command_calibrate(args: argparse.Namespace) -> int:
    from vtprune.eval.calibrate import calibrate, calibration_items, plot

    from vtprune.loading import load, model_label

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}.")
    method = args.method.split("+")[0]
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    items = calibration_items(args.data, args.n)
    result = calibrate(model, processor, items, method, args.layer, args.batch_size, args.bins,
                       model_name=model_label(args.model))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    image = plot(result, out.with_suffix(".png"))
    for key, entry in result["layers"].items():
        print(f"score layer {key}: sigma {entry['sigma']:.3f}  mu {entry['mu']:.3f}  r2 {entry['r2']:.3f}  "
              f"({entry['n_pairs']} pairs)")
    print(f"wrote {out}" + (f" and {image}" if image else " (no plot: matplotlib is not installed)"))
    return 0
