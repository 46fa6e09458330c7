"""Run conditions, Markdown tables and PNG plots for ``vtprune bench`` results (CSV in, files out)."""

from __future__ import annotations

import csv
import datetime
import platform
import subprocess
from collections import defaultdict
from pathlib import Path


def git_sha() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def conditions(model, args) -> dict:
    """Device, dtype, attention implementation, batch, versions and git SHA of a run."""
    import torch
    import transformers

    import vtprune

    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'x86_64'})"
    return {"device": name, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
            "attn_implementation": args.attn, "batch_size": getattr(args, "batch_size", 1),
            "torch": torch.__version__, "transformers": transformers.__version__, "vtprune": vtprune.__version__,
            "git_sha": git_sha(), "date": datetime.date.today().isoformat()}


def read_rows(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return list(csv.DictReader(f))


def markdown_table(rows: list[dict]) -> str:
    """Overall accuracy / evidence recall / cost per method and keep, then accuracy per question type."""
    overall = [r for r in rows if r["qtype"] == "all"]
    lines = ["| method | keep | accuracy | evidence recall | kept tokens | FLOPs ratio | prefill p50 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in overall:
        lines.append(f"| {r['method']} | {float(r['keep']):g} | {float(r['accuracy']):.3f} | "
                     f"{_fmt(r['evidence_recall'])} | {float(r['mean_kept']):.1f} | {float(r['flops_ratio']):.3f} | "
                     f"{float(r['prefill_ms_p50']):.2f} |")
    qtypes = sorted({r["qtype"] for r in rows} - {"all"})
    lines += ["", "Accuracy per question type:", "",
              "| method | keep | " + " | ".join(qtypes) + " |", "|---|---|" + "---|" * len(qtypes)]
    by_key = defaultdict(dict)
    for r in rows:
        by_key[(r["method"], r["keep"])][r["qtype"]] = float(r["accuracy"])
    for (method, keep), values in by_key.items():
        lines.append(f"| {method} | {float(keep):g} | " + " | ".join(f"{values.get(q, float('nan')):.2f}"
                                                                   for q in qtypes) + " |")
    first = rows[0]
    lines += ["", f"Conditions: model {first['model']}, device {first['device']} ({first['threads']} threads), "
              f"dtype {first['dtype']}, attention {first['attn_implementation']}, batch {first['batch_size']} "
              f"(timings: batch 1), torch {first['torch']}, transformers {first['transformers']}, "
              f"vtprune {first['vtprune']} @ {first['git_sha']}, {first['date']}."]
    return "\n".join(lines) + "\n"


def _fmt(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value
    return "n/a" if number != number else f"{number:.3f}"


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``accuracy_recall_vs_keep.png`` and ``accuracy_vs_prefill.png``, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = [r for r in rows if r["qtype"] == "all"]
    methods = sorted({r["method"] for r in overall}, key=lambda m: [r["method"] for r in overall].index(m))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method in methods:
        points = sorted((float(r["keep"]), float(r["accuracy"]), float(r["evidence_recall"]))
                        for r in overall if r["method"] == method)
        keeps = [p[0] for p in points]
        axes[0].plot(keeps, [p[1] for p in points], marker="o", label=method)
        axes[1].plot(keeps, [p[2] for p in points], marker="o", label=method)
    for ax, title in zip(axes, ("accuracy", "evidence recall")):
        ax.set_xscale("log")
        ax.set_xlabel("keep (fraction of visual tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"vtprune-shapes, {overall[0]['model']}")
    fig.tight_layout()
    first = out / "accuracy_recall_vs_keep.png"
    fig.savefig(first, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        points = sorted((float(r["prefill_ms_p50"]), float(r["accuracy"])) for r in overall if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    ax.set_xlabel("measured prefill ms (p50, batch 1)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    second = out / "accuracy_vs_prefill.png"
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return [first, second]


def write_report(csv_path: Path, out: Path) -> None:
    rows = read_rows(csv_path)
    (out / "bench.md").write_text(markdown_table(rows))
    plot(rows, out)
