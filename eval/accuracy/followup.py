"""``vtprune bench followup``: the quality cost of answering a follow-up question on a pruned cache.

Per test image of the vtprune-shapes task: turn 1 asks one question, turn 2 another about the same image.
``reuse`` answers turn 2 from turn 1's cache (what a query-aware method pruned was chosen for question 1);
``reprefill`` re-runs the conversation with the image (pruning chosen for question 2). Writes
``followup.csv`` / ``followup.md``: turn-2 accuracy per method and mode, and the cost (reprefill - reuse).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from tqdm import tqdm
from vtprune.eval.accuracy.report import conditions

import vtprune
from vtprune.models.chat import chat
from vtprune.models.loading import load, model_label
from vtprune.shapes.task import make_split

METHODS = "none,random,fastv,pdrop,transprune,vflowopt,prefixkv"
QUERY_AWARE = ("fastv", "pdrop", "transprune", "prefixkv")


def run(model, processor, images: int, methods: list[str], keep: float, split: str = "test") -> list[dict]:
    samples = make_split(split, images)
    rows = []
    for method in methods:
        for mode in ("reuse", "reprefill"):
            correct = turn1 = 0
            handle = None if method == "none" else vtprune.wrap(model, method, keep=keep)
            try:
                for sample in tqdm(samples, desc=f"{method} {mode}", leave=False):
                    first, second = sample.questions[0], sample.questions[1]
                    answers = chat(model, processor, sample.image, [first.text, second.text], followup=mode)
                    turn1 += answers[0].lower() == first.answer.lower()
                    correct += answers[1].lower() == second.answer.lower()
            finally:
                if handle is not None:
                    handle.remove()
            rows.append({"method": method, "keep": 1.0 if method == "none" else keep, "mode": mode,
                         "turn1_accuracy": round(turn1 / len(samples), 4),
                         "turn2_accuracy": round(correct / len(samples), 4), "images": len(samples),
                         "query_aware": method in QUERY_AWARE})
    return rows


def table(rows: list[dict], facts: dict) -> str:
    by = {(r["method"], r["mode"]): r for r in rows}
    lines = ["| method | query-aware | turn-1 acc | turn-2 acc, reuse | turn-2 acc, reprefill | cost of reuse |",
             "|---|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        reuse, again = by[(method, "reuse")], by[(method, "reprefill")]
        lines.append(f"| {method} | {'yes' if reuse['query_aware'] else 'no'} | {reuse['turn1_accuracy']:.3f} | "
                     f"{reuse['turn2_accuracy']:.3f} | {again['turn2_accuracy']:.3f} | "
                     f"{again['turn2_accuracy'] - reuse['turn2_accuracy']:+.3f} |")
    lines.append(f"\n{rows[0]['images']} images, keep {rows[-1]['keep']}, two questions each (test split), greedy, "
                 f"batch 1. Conditions: model {facts['model']}, {facts['device']} ({facts['threads']} thread{'' if str(facts['threads']) == '1' else 's'}), "
                 f"{facts['dtype']}, {facts['attn_implementation']}, torch {facts['torch']}, transformers "
                 f"{facts['transformers']}, vtprune @ {facts['git_sha']}, weights {facts['weights_sha']}.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options; a bad value is one ``error:`` line and exit status 2, before any model is loaded."""
    from vtprune.cli.checks import OneLineParser, int_range, keep_fraction, name_list
    from vtprune.cli.outputs import add_force_argument

    parser = OneLineParser(prog="vtprune bench followup", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded LLaVA")
    parser.add_argument("--images", type=int_range(1, 100_000), default=100, help="test images (two questions each)")
    parser.add_argument("--methods", type=name_list, default=METHODS,
                        help="comma-separated methods ('none' is the unpruned reference)")
    parser.add_argument("--keep", type=keep_fraction, default=0.25, help="keep fraction of the pruned methods")
    parser.add_argument("--threads", type=int_range(1, 1024), default=2, help="torch CPU threads")
    parser.add_argument("--out", default="runs/followup", help="output folder (followup.csv, followup.md)")
    add_force_argument(parser)
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> Path:
    """Methods, model and output folder, checked before any work; the output folder."""
    from vtprune.cli.checks import check_output_dir, known_methods
    from vtprune.cli.outputs import check_new_results
    from vtprune.models.loading import check_model_spec

    known_methods(args.methods.split(","), "--methods")
    check_model_spec(args.model)
    check_output_dir(args.out)
    return check_new_results(args.out, ("followup.csv", "followup.md"), args.force)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = check_args(args)
    torch.set_num_threads(args.threads)
    model, processor = load(args.model, device="cpu")
    rows = run(model, processor, args.images, args.methods.split(","), args.keep)
    args.attn, args.batch_size = "sdpa", 1
    facts = {**conditions(model, args), "model": model_label(args.model)}
    out.mkdir(parents=True, exist_ok=True)
    with (out / "followup.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *facts])
        writer.writeheader()
        writer.writerows({**r, **facts} for r in rows)
    (out / "followup.md").write_text(table(rows, facts))
    print(table(rows, facts))
    return out


if __name__ == "__main__":
    main()
