"""Run conditions, Markdown tables and PNG plots for ``vtprune bench`` results (CSV in, files out)."""

from __future__ import annotations

import csv
import datetime
import math
import platform
from collections import defaultdict
from pathlib import Path

from vtprune.eval.provenance import git_state, weights_fingerprint


def git_sha() -> str:
    return str(git_state()["git_sha"])


def dirty(row: dict) -> str:
    """`` (dirty tree)`` when a results row says the tree had uncommitted changes, else ``""``."""
    return " (dirty tree)" if str(row.get("git_dirty", "False")) == "True" else ""


def conditions(model, args) -> dict:
    """Device, dtype, attention implementation, batch, versions, git SHA / dirty flag and weights fingerprint."""
    import torch
    import transformers

    import vtprune

    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'x86_64'})"
    return {"device": name, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
            "attn_implementation": args.attn, "batch_size": getattr(args, "batch_size", 1),
            "torch": torch.__version__, "transformers": transformers.__version__, "vtprune": vtprune.__version__,
            **git_state(), "weights_sha": weights_fingerprint(model), "date": datetime.date.today().isoformat()}


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
    visual = max((float(r["mean_kept"]) for r in overall if r["method"] == "none"), default=16.0)
    lines += ["", *legend(int(round(visual)))]
    lines += _per_type_table(rows, "accuracy", "Accuracy per question type:", lambda v: f"{float(v):.2f}")
    lines += _per_type_table(rows, "evidence_recall", "Evidence recall per question type:", _fmt)
    lines += ["", *best_criteria(rows)]
    first = rows[0]
    lines += ["", f"Conditions: model {first['model']}, device {first['device']} ({first['threads']} thread{'' if str(first['threads']) == '1' else 's'}), "
              f"dtype {first['dtype']}, attention {first['attn_implementation']}, batch {first['batch_size']} "
              f"(timings: batch 1), torch {first['torch']}, transformers {first['transformers']}, "
              f"vtprune {first['vtprune']} @ {first['git_sha']}{dirty(first)}, weights {first.get('weights_sha', '?')}, "
              f"{first['date']}."]
    return "\n".join(lines) + "\n"


def legend(visual_tokens: int = 16) -> tuple[str, ...]:
    """The paragraphs under the overall table (``visual_tokens``: the unpruned model's visual tokens per image)."""
    return (
        "Columns: *accuracy*, exact match of the one-word answer; *evidence recall*, the fraction of the visual "
        "tokens that cover the answer's object(s) (known from the generator's boxes) still kept after the last "
        "stage (1 = nothing relevant dropped); *kept tokens*, visual tokens left after the last stage (mean); "
        "*FLOPs ratio*, LM prefill FLOPs pruned / unpruned from the kept counts per layer (theory; vision tower "
        "not counted); *prefill p50 ms*, the measured prompt forward (vision tower + LM) at batch 1, median.",
        "",
        f"On a model this small ({visual_tokens} visual tokens, 4 layers) the text tokens and the fixed cost of "
        "scoring and slicing dominate, so a pruned prefill is often no faster, or slower, than the unpruned one and the "
        "timings are within noise; `vtprune bench --speed` measures speed at realistic geometry (576 to 2880 "
        "visual tokens). Keep 1 is the unpruned model, run once as `none`: every method keeps every token there.",
    )


def _per_type_table(rows: list[dict], column: str, title: str, fmt) -> list[str]:
    """Markdown lines: one row per (method, keep), one column per question type, cells ``fmt(row[column])``."""
    qtypes = sorted({r["qtype"] for r in rows} - {"all"})
    cells: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for r in rows:
        cells[(r["method"], r["keep"])][r["qtype"]] = fmt(r[column])
    lines = ["", title, "", "| method | keep | " + " | ".join(qtypes) + " |", "|---|---|" + "---|" * len(qtypes)]
    for (method, keep), values in cells.items():
        lines.append(f"| {method} | {float(keep):g} | " + " | ".join(values.get(q, "n/a") for q in qtypes) + " |")
    return lines


REFERENCE_METHODS = ("none", "random", "oracle")  # reference lines, not criteria


def answered_types(rows: list[dict], floor: float = 0.5) -> list[str]:
    """Question types the unpruned model answers (accuracy >= ``floor`` at keep 1 with method ``none``)."""
    return sorted(r["qtype"] for r in rows if r["method"] == "none" and float(r["keep"]) == 1.0
                  and r["qtype"] != "all" and float(r["accuracy"]) >= floor)


def pooled(rows: list[dict], method: str, keep: float, qtypes: list[str], column: str) -> float:
    """``column`` averaged over the questions of ``qtypes`` (each type weighted by its ``n``)."""
    picked = [r for r in rows if r["method"] == method and float(r["keep"]) == keep and r["qtype"] in qtypes]
    total = sum(int(r["n"]) for r in picked)
    return sum(int(r["n"]) * float(r[column]) for r in picked) / total if total else float("nan")


# (keep, share of the unpruned accuracy) the best criterion is compared with; the evidence recall level at keep 0.25
ACCURACY_LEVELS = ((0.25, 0.97), (0.11, 0.93), (0.1, 0.90))
RECALL_LEVEL = 0.8


def best_criteria(rows: list[dict]) -> list[str]:
    """The best criterion at each keep: its accuracy as a share of the unpruned accuracy, compared with
    :data:`ACCURACY_LEVELS` (97 / 93 / 90 % at keep 0.25 / 0.11 / 0.1), and its evidence recall at keep 0.25,
    compared with :data:`RECALL_LEVEL`.

    Recall is given over all questions and over the question types the unpruned model answers: on a type it
    never answers (for example reading numbers on a model that did not learn to read), its attention does not
    look for the evidence, so attention-based recall there measures the model, not the criterion.
    """
    overall = {(r["method"], float(r["keep"])): r for r in rows if r["qtype"] == "all"}
    base = overall.get(("none", 1.0))
    # KV-cache retention (prefixkv: FLOPs ratio 1 below keep 1) keeps every token through the prefill, so a
    # one-word answer, read from the prefill's last position, cannot change: the accuracy comparison is for the
    # methods that shorten the sequence.
    kv_only = {m for (m, keep), r in overall.items() if keep < 1 and float(r["flops_ratio"]) >= 1.0 - 1e-9}
    methods = [m for m in dict.fromkeys(m for m, _ in overall) if m not in REFERENCE_METHODS and m not in kv_only]
    if base is None or not methods or float(base["accuracy"]) == 0:
        return []  # no unpruned reference to compare with (e.g. a random-weight model)
    answered = answered_types(rows)
    lines = ["The best criterion at each keep (reference lines and KV-cache-only methods excluded), its accuracy as "
             "a share of the unpruned accuracy against the levels 97 / 93 / 90 % at keep 0.25 / 0.11 / 0.1, its "
             f"evidence recall against {RECALL_LEVEL} at keep 0.25; they describe the methods on this model and "
             "task, not whether this run worked:", ""]
    for keep, level in ACCURACY_LEVELS:
        scored = [(float(overall[m, keep]["accuracy"]), m) for m in methods if (m, keep) in overall]
        if scored:
            acc, m = max(scored)
            ratio = acc / float(base["accuracy"])
            shown = math.floor(1000 * ratio + 1e-9) / 10  # rounded down: 96.99 % shows as 96.9, never as 97.0
            lines.append(f"- keep {keep:g}: accuracy {acc:.3f} ({m}) = {shown:.1f} % of unpruned "
                         f"{float(base['accuracy']):.3f} ({against(ratio, level, 100 * level, ' %')})")
    if any((m, 0.25) in overall for m in methods):
        rec, m = max((float(overall[m, 0.25]["evidence_recall"]), m) for m in methods if (m, 0.25) in overall)
        lines.append(f"- keep 0.25: evidence recall {rec:.3f} ({m}), all questions "
                     f"({against(rec, RECALL_LEVEL, RECALL_LEVEL)})")
        sub = max((pooled(rows, m, 0.25, answered, "evidence_recall"), m) for m in methods if (m, 0.25) in overall)
        lines.append(f"- keep 0.25: evidence recall {sub[0]:.3f} ({sub[1]}) on the types the unpruned model "
                     f"answers ({', '.join(answered)})")
    return lines


def against(value: float, level: float, shown: float, unit: str = "") -> str:
    """``>= LEVEL`` or ``< LEVEL``: where ``value`` stands against ``level`` (printed as ``shown`` + ``unit``)."""
    return f"{'>=' if value >= level else '<'} {shown:g}{unit}"


def _fmt(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value
    return "n/a" if number != number else f"{number:.3f}"


def line_style(index: int) -> dict:
    """Colour, marker and dash of the ``index``-th method's line (10 colours, then new markers and dashes)."""
    return {"color": f"C{index % 10}", "marker": "os^D"[index // 10 % 4], "linestyle": ("-", "--", ":", "-.")[index // 10 % 4]}


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``accuracy_recall_vs_keep.png`` and ``accuracy_vs_prefill.png``, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = [r for r in rows if r["qtype"] == "all"]
    methods = sorted({r["method"] for r in overall}, key=lambda m: [r["method"] for r in overall].index(m))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    base = [r for r in overall if r["method"] == "none" and float(r["keep"]) == 1.0]
    for index, method in enumerate(methods):
        mine = [r for r in overall if r["method"] == method]
        if method != "none" and all(float(r["keep"]) < 1.0 for r in mine):
            mine = base + mine  # keep 1 ran once, as "none": the line starts at the unpruned model
        points = sorted((float(r["keep"]), float(r["accuracy"]), float(r["evidence_recall"])) for r in mine)
        keeps = [p[0] for p in points]
        axes[0].plot(keeps, [p[1] for p in points], label=method, **line_style(index))
        axes[1].plot(keeps, [p[2] for p in points], label=method, **line_style(index))
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
    for index, method in enumerate(methods):
        points = sorted((float(r["prefill_ms_p50"]), float(r["accuracy"])) for r in overall if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], label=method, **line_style(index))
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
