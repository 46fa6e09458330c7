"""Summary CSV, Markdown and PNG of ``vtprune.eval.accuracy.long`` (records.jsonl in, files out).

One CSV row per context group (``16-32 frames``, ``8 images``, ...) x method x keep x question type (plus
``all``), with the run conditions. The Markdown has, per group: accuracy and token-level evidence recall of
every method at every keep, accuracy per question type, cost (FLOPs ratio, kept tokens, time), and the best
criterion among the token methods (reference lines ``random`` / ``oracle`` excluded) at keep 0.25 and 0.1 against
fixed levels: 97 % / 90 % of the unpruned accuracy, evidence recall 0.8 at keep 0.25.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
from vtprune.eval.accuracy.report import against, dirty

REFERENCES = ("none", "random", "oracle", "random@per_frame", "oracle@per_frame")
ACCURACY_LEVELS = ((0.25, 0.97), (0.1, 0.90))  # (keep, share of the unpruned accuracy) the best criterion is compared with
RECALL_LEVEL = 0.8  # the evidence recall the best criterion at keep 0.25 is compared with


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return round(float(np.mean(kept)), 4) if kept else float("nan")


def summarise(records: list[dict]) -> list[dict]:
    """One row per group x method x keep x question type (``all`` first), in first-seen order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        for qtype in ("all", r["qtype"]):
            groups[(r["group"], r["method"], float(r["keep"]), qtype)].append(r)
    rows = []
    for (group, method, keep, qtype), rs in groups.items():
        times = [r["ms"] for r in rs]
        rows.append({
            "group": group, "method": method, "budget": rs[0]["budget"], "keep": keep, "qtype": qtype, "n": len(rs),
            "accuracy": _mean([r["correct"] for r in rs]), "evidence_recall": _mean([r["recall"] for r in rs]),
            "evidence_hit": _mean([r["hit"] for r in rs]), "best_frame_recall": _mean([r["best_frame"] for r in rs]),
            "mean_frames": _mean([r["frames"] for r in rs]), "mean_visual_tokens": _mean([r["visual"] for r in rs]),
            "mean_kept_tokens": _mean([r["kept"] for r in rs]),
            "lm_gflops": round(sum(r["flops"] for r in rs) / len(rs) / 1e9, 6),
            "flops_ratio": round(sum(r["flops"] for r in rs) / sum(r["baseline_flops"] for r in rs), 4),
            **{f"time_ms_p{p}": round(float(np.percentile(times, p)), 2) for p in (20, 50, 80)}})
    return rows


def _cell(rows: dict, key: tuple, column: str, digits: int = 3) -> str:
    row = rows.get(key)
    if row is None:
        return "–"
    value = float(row[column])
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def group_tables(rows: list[dict], group: str, keeps: list[float]) -> list[str]:
    """Accuracy / recall, per-type accuracy and cost tables of one group."""
    overall = {(r["method"], float(r["keep"])): r for r in rows if r["group"] == group and r["qtype"] == "all"}
    typed = {(r["method"], float(r["keep"]), r["qtype"]): r for r in rows if r["group"] == group}
    methods = list(dict.fromkeys(m for m, _ in overall))
    qtypes = sorted({r["qtype"] for r in rows if r["group"] == group} - {"all"})
    base = overall.get(("none", 1.0))
    lines = [f"### {group}", ""]
    if base is not None:
        per_type = ", ".join(f"{q} {_cell(typed, ('none', 1.0, q), 'accuracy')}" for q in qtypes)
        lines += [f"Unpruned (`none`): accuracy {float(base['accuracy']):.3f} on {base['n']} questions, "
                  f"{float(base['mean_visual_tokens']):.0f} visual tokens on average "
                  f"(per type: {per_type}).", ""]
    lines += ["| method | " + " | ".join(f"acc {k:g}" for k in keeps) + " | "
              + " | ".join(f"recall {k:g}" for k in keeps) + " |", "|---|" + "---|" * (2 * len(keeps))]
    for m in methods:
        if m in ("none", "gridprobe"):
            continue
        lines.append(f"| {m} | " + " | ".join(_cell(overall, (m, k), "accuracy") for k in keeps) + " | "
                     + " | ".join(_cell(overall, (m, k), "evidence_recall") for k in keeps) + " |")
    if ("gridprobe", 1.0) in overall:
        g = overall[("gridprobe", 1.0)]
        lines += ["", f"`gridprobe` alone (its frames unpruned, K probes counted): accuracy {float(g['accuracy']):.3f}, "
                  f"evidence recall {float(g['evidence_recall']):.3f}, {float(g['mean_frames']):.2f} frames, FLOPs "
                  f"ratio {float(g['flops_ratio']):.3f}. `gridprobe+NAME` rows prune its frames at `keep`."]
    lines += ["", "Accuracy per question type at keep 0.25 / 0.1:", "",
              "| method | " + " | ".join(f"{q} 0.25 | {q} 0.1" for q in qtypes) + " |",
              "|---|" + "---|" * (2 * len(qtypes))]
    for m in methods:
        if m in ("none", "gridprobe"):
            continue
        lines.append(f"| {m} | " + " | ".join(f"{_cell(typed, (m, 0.25, q), 'accuracy', 2)} | "
                                              f"{_cell(typed, (m, 0.1, q), 'accuracy', 2)}" for q in qtypes) + " |")
    lines += ["", "Cost and recall detail (FLOPs ratio: LM prefill over the unpruned all-frames pass, probes included "
              "for GridProbe; kept: visual tokens after the last stage; hit / best frame at keep 0.25):", "",
              "| method | " + " | ".join(f"FLOPs {k:g}" for k in keeps) + " | kept 0.25 | hit 0.25 | best frame 0.25 "
              "| time p50 ms 0.25 |", "|---|" + "---|" * (len(keeps) + 4)]
    for m in methods:
        if m in ("none", "gridprobe"):
            continue
        lines.append(f"| {m} | " + " | ".join(_cell(overall, (m, k), "flops_ratio") for k in keeps)
                     + f" | {_cell(overall, (m, 0.25), 'mean_kept_tokens', 1)} | {_cell(overall, (m, 0.25), 'evidence_hit')}"
                     f" | {_cell(overall, (m, 0.25), 'best_frame_recall')} | {_cell(overall, (m, 0.25), 'time_ms_p50', 0)} |")
    if base is not None:
        lines += ["", f"Unpruned time p50: {_cell(overall, ('none', 1.0), 'time_ms_p50', 0)} ms."]
    return lines + [""]


def best_criteria(rows: list[dict], group: str) -> list[str]:
    """The best token criterion of one group (references and GridProbe excluded) at each keep of
    :data:`ACCURACY_LEVELS`, against its level, and its evidence recall against :data:`RECALL_LEVEL`."""
    overall = {(r["method"], float(r["keep"])): r for r in rows if r["group"] == group and r["qtype"] == "all"}
    base = overall.get(("none", 1.0))
    criteria = [m for m in dict.fromkeys(m for m, _ in overall) if m not in REFERENCES and not m.startswith("gridprobe")]
    if base is None or not criteria or float(base["accuracy"]) == 0:
        return []
    lines = []
    for keep, level in ACCURACY_LEVELS:
        scored = [(float(overall[m, keep]["accuracy"]), m) for m in criteria if (m, keep) in overall]
        if scored:
            acc, m = max(scored)
            ratio = acc / float(base["accuracy"])
            shown = math.floor(1000 * ratio + 1e-9) / 10
            lines.append(f"- {group}, keep {keep:g}: best {m} {acc:.3f} = {shown:.1f} % of unpruned "
                         f"{float(base['accuracy']):.3f} ({against(ratio, level, 100 * level, ' %')})")
    recalls = [(float(overall[m, 0.25]["evidence_recall"]), m) for m in criteria if (m, 0.25) in overall]
    if recalls:
        rec, m = max(recalls)
        lines.append(f"- {group}, keep 0.25: best evidence recall {rec:.3f} ({m}) "
                     f"({against(rec, RECALL_LEVEL, RECALL_LEVEL)})")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    keeps = sorted({float(r["keep"]) for r in rows if float(r["keep"]) < 1}, reverse=True)
    groups = list(dict.fromkeys(r["group"] for r in rows))
    lines = [f"# Long visual contexts: {meta['setting']} ({meta['model']})", "",
             "Columns: *acc*, exact match of the one-word answer; *recall*, token-level evidence recall: the "
             "fraction of the visual tokens covering the target (in every evidence frame / the target image) kept "
             "after the last stage; *hit*, share of questions with at least one evidence token kept; *best frame*, "
             "the largest kept fraction of the target's tokens in a single evidence frame. `NAME` prunes with one "
             "budget over the whole prompt, `NAME@per_frame` gives every frame (image) its own keep_count. "
             "`random` and `oracle` (evidence tokens first) are reference lines.", ""]
    for group in groups:
        lines += group_tables(rows, group, keeps)
    lines += ["## The best token method per setting", "",
              "Accuracy as a share of the unpruned accuracy against 97 % at keep 0.25 and 90 % at keep 0.1; evidence "
              f"recall against {RECALL_LEVEL} at keep 0.25 (`random`, `oracle` and GridProbe excluded):", ""]
    for group in groups:
        lines += best_criteria(rows, group)
    lines += ["", f"Conditions: model {meta['model']}, device {meta['device']} ({meta['threads']} thread"
              f"{'' if str(meta['threads']) == '1' else 's'}), dtype {meta['dtype']}, attention "
              f"{meta['attn_implementation']}, route {meta['route']}, batch 1, answers by greedy generation "
              f"(4 tokens), split {meta['split']}"
              + (f", GridProbe K = {meta['k']}" if meta.get("k") else "")
              + (f", +debias with {meta['debias_file']}" if meta.get("debias_file") else "")
              + f"; torch {meta['torch']}, transformers {meta['transformers']}, vtprune {meta['vtprune']} @ "
              f"{meta['git_sha']}{dirty(meta)}, weights {meta.get('weights_sha', '?')}, {meta['date']}."]
    return "\n".join(lines) + "\n"


PALETTE = {"fastv": "C3", "pdrop": "C4", "transprune": "C5", "ttv": "C6", "dart": "teal", "divprune": "C8",
           "visionzip": "C9", "vflowopt": "C0", "temporal": "C2", "fastv+debias": "C1", "pdrop+debias": "C1"}


def line_style(method: str) -> dict:
    """Colour by base method (oracle black, random grey); dashed: per-frame budgets; dotted: GridProbe / temporal."""
    base = method.split("@")[0].replace("gridprobe+", "")
    colour = {"oracle": "black", "random": "grey"}.get(base, PALETTE.get(base, "C0"))
    dashed = "per_frame" in method or method.startswith("temporal@")
    dotted = method.startswith("gridprobe")
    marker = {"oracle": "s", "random": "x"}.get(base, "^" if dotted else "o")
    return {"color": colour, "linestyle": ":" if dotted else "--" if dashed else "-", "marker": marker,
            "markersize": 4, "linewidth": 1.2}


def plot(rows: list[dict], meta: dict, path: Path) -> Path:
    """Accuracy and evidence recall versus keep, one panel pair per group, conditions in the footer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.8 * len(groups) + 0.6), squeeze=False)
    for g, group in enumerate(groups):
        overall = [r for r in rows if r["group"] == group and r["qtype"] == "all"]
        base = [r for r in overall if r["method"] == "none"]
        methods = [m for m in dict.fromkeys(r["method"] for r in overall) if m not in ("none", "gridprobe")]
        for method in methods:
            mine = sorted((float(r["keep"]), float(r["accuracy"]), float(r["evidence_recall"]))
                          for r in overall if r["method"] == method)
            for ax, column in zip(axes[g], (1, 2), strict=True):
                ax.plot([p[0] for p in mine], [p[column] for p in mine], label=method, **line_style(method))
        if base:
            axes[g][0].axhline(float(base[0]["accuracy"]), color="black", linewidth=0.8, label="unpruned")
        for ax, title in zip(axes[g], ("accuracy", "token evidence recall"), strict=True):
            ax.set_xscale("log")
            ax.set_xticks(sorted({float(r["keep"]) for r in overall if float(r["keep"]) < 1}))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("keep")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{group}: {title}")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.text(0.01, 0.005, f"{meta['model']}, {meta['setting']}, split {meta['split']}, cpu {meta['threads']} thread(s), "
             f"vtprune @ {meta['git_sha']}{dirty(meta)}, weights {meta.get('weights_sha', '?')}, {meta['date']}",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(journal: Path, out: Path, meta: dict) -> Path:
    """``long.csv``, ``long.md`` and ``long.png`` in ``out`` from the records; returns the CSV path."""
    records = [json.loads(line) for line in Path(journal).read_text().splitlines() if line.strip()]
    rows = [{**r, **meta} for r in summarise(records)]
    path = out / "long.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "long.md").write_text(markdown(rows, meta))
    plot(rows, meta, out / "long.png")
    return path
