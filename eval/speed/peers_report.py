"""Rows, CSV, Markdown table and plot of ``python -m vtprune.eval.speed.peers`` (vtprune vs AngelSlim)."""

from __future__ import annotations

import csv
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

COLUMNS = ("model", "model_label", "method", "angelslim_strategy", "keep", "side", "status", "transformers", "runs",
           "ttft_ms_p20", "ttft_ms_p50", "ttft_ms_p80", "e2e_ms_p20", "e2e_ms_p50", "e2e_ms_p80", "decode_ms_p50",
           "peak_rss_mb_p50", "dense_peak_rss_mb_p50", "dense_ttft_ms_p50", "dense_e2e_ms_p50", "speedup_ttft", "speedup_e2e",
           "visual_tokens", "kept_tokens", "answers_equal_other", "answers_equal_dense", "dense_equal_across", "batch",
           "batch2",
           "new_tokens", "threads", "dtype", "attn", "torch", "git_sha", "date")
PEER = {"vtprune": ("dense", "angelslim"), "angelslim": ("angelslim_dense", "vtprune")}


def _p(values: list[float], q: int) -> float:
    from vtprune.eval.speed.measure import percentiles

    return round(percentiles(values, (q,))[q], 2) if values else float("nan")


def answer(tokens: list[int], eos: int | None) -> list[int]:
    """``tokens`` up to and including the first ``eos``."""
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def _answers(runs: list[dict], eos: int | None) -> dict[int, list[int]]:
    """The first timed run's answer per sample (greedy, so every repeat gives the same tokens)."""
    out: dict[int, list[int]] = {}
    for run in runs:
        if "tokens" in run:
            out.setdefault(run["sample"], answer(run["tokens"], eos))
    return out


def _agree(a: dict[int, list[int]], b: dict[int, list[int]]) -> str:
    shared = sorted(set(a) & set(b))
    return f"{sum(a[s] == b[s] for s in shared)}/{len(shared)}" if shared else ""


def summarise(kind: str, label: str, method: str, args, runs: dict[str, list[dict]], eos: int | None,
              probe: str) -> list[dict]:
    """One row per side (vtprune, angelslim when measured) of one model x method; ``runs``: ``{side: [run]}``."""
    import torch
    from vtprune.eval.speed.peers_worker import PAIRS

    answers = {side: _answers(r, eos) for side, r in runs.items()}
    rows = []
    for side in ("vtprune", "angelslim"):
        if side not in runs:
            continue
        dense_side, other = PEER[side]
        ok = [r for r in runs[side] if "error" not in r]
        dense = [r for r in runs[dense_side] if "error" not in r]
        errors = [r["error"] for r in runs[side] if "error" in r]
        row = {"model": kind, "model_label": label, "method": method, "angelslim_strategy": PAIRS[method].strategy,
               "keep": args.keep, "side": side, "status": errors[0] if errors else "ok", "runs": len(ok),
               "transformers": args.versions[side], "batch": 1, "new_tokens": args.new_tokens,
               "threads": args.threads, "dtype": "float32", "attn": "sdpa", "torch": torch.__version__}
        for name in ("ttft", "e2e"):
            values = [r[f"{name}_ms"] for r in ok]
            row.update({f"{name}_ms_p{q}": _p(values, q) for q in (20, 50, 80)})
            row[f"dense_{name}_ms_p50"] = _p([r[f"{name}_ms"] for r in dense], 50)
            row[f"speedup_{name}"] = round(row[f"dense_{name}_ms_p50"] / row[f"{name}_ms_p50"], 3) if ok else ""
        row["decode_ms_p50"] = _p([r["decode_ms"] for r in ok], 50)
        row["peak_rss_mb_p50"] = _p([r["peak_bytes"] / 2**20 for r in ok], 50)
        row["dense_peak_rss_mb_p50"] = _p([r["peak_bytes"] / 2**20 for r in dense], 50)
        row["visual_tokens"] = "/".join(sorted({str(r["visual"]) for r in ok}))
        row["kept_tokens"] = "/".join(sorted({str(r["kept"]) for r in ok}))
        row["answers_equal_other"] = _agree(answers[side], answers[other]) if other in answers else ""
        row["answers_equal_dense"] = _agree(answers[side], answers[dense_side])
        row["dense_equal_across"] = _agree(answers["dense"], answers.get("angelslim_dense", {}))
        row["batch2"] = probe if side == "angelslim" else "ok (vtprune batches; not timed here)"
        rows.append(row)
    return rows


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)" if names else platform.processor()
    except OSError:
        return platform.processor() or "unknown"


def conditions(args, worker_info: dict) -> list[str]:
    """The run's conditions, one Markdown bullet each."""
    import torch
    import transformers
    from vtprune.eval.provenance import git_state

    git = git_state()
    load = os.getloadavg()
    rev = "not measured"
    if worker_info.get("ok"):
        src = Path(args.angelslim_src) if args.angelslim_src else None
        rev = (src / "REVISION").read_text().strip() if src and (src / "REVISION").is_file() else "installed package"
    return [
        f"- CPU: {_cpu()}; torch threads {args.threads} per side; float32; SDPA attention; batch 1; greedy "
        f"`generate(max_new_tokens={args.new_tokens})` (end-of-sequence off: every run makes {args.new_tokens} tokens)",
        f"- vtprune side: torch {torch.__version__}, transformers {transformers.__version__}, git {git['git_sha']}"
        f"{' (dirty tree)' if git['git_dirty'] else ''}",
        f"- AngelSlim side: {rev}; torch {worker_info.get('torch', '?')}, transformers "
        f"{worker_info.get('transformers', '?')} (its own process; "
        f"{'measured' if worker_info.get('ok') else 'skipped: ' + worker_info.get('reason', '')})",
        f"- keep {args.keep} (AngelSlim ratio {round(1 - args.keep, 4)}); {args.repeats} timed rounds after one "
        f"warm-up round, four sides per sample and round in a rotating order; embedded model: {args.samples} "
        "inputs; p50 over all timed runs",
        f"- machine load (1/5/15-min load average at the end): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on a "
        "CPU shared with other jobs: absolute times are noisy, the interleaving keeps the sides comparable",
        f"- date {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
    ]


def markdown(rows: list[dict], lines: list[str]) -> str:
    """The results page: one table per model, then the conditions."""
    out = ["# vtprune vs AngelSlim token_compressor: speed, same model, same keep, interleaved", ""]
    for kind in dict.fromkeys(r["model"] for r in rows):
        group = [r for r in rows if r["model"] == kind]
        out += [f"## {group[0]['model_label']}", "",
                "| method (AngelSlim name) | side | TTFT ms p50 | e2e ms p50 | decode ms/token | unpruned TTFT / e2e ms "
                "(same process) | speedup vs unpruned TTFT / e2e | kept / visual | answers = other side | answers = "
                "unpruned | peak RSS MB (unpruned) | batch 2 |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            status = "" if r["status"] == "ok" else f" ({r['status']})"
            out.append(f"| {r['method']} ({r['angelslim_strategy']}) | {r['side']}{status} | {r['ttft_ms_p50']} | "
                       f"{r['e2e_ms_p50']} | {r['decode_ms_p50']} | {r['dense_ttft_ms_p50']} / {r['dense_e2e_ms_p50']} | "
                       f"{r['speedup_ttft']} / {r['speedup_e2e']} | "
                       f"{r['kept_tokens']} / {r['visual_tokens']} | {r['answers_equal_other']} | "
                       f"{r['answers_equal_dense']} | {r['peak_rss_mb_p50']} ({r['dense_peak_rss_mb_p50']}) | {r['batch2']} |")
        out.append("")
    out += ["## Conditions", "", *lines, ""]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Bars of TTFT and end-to-end time per method, vtprune vs AngelSlim, one row of panels per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.6 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        group = [r for r in rows if r["model"] == kind and r["status"] == "ok"]
        methods = list(dict.fromkeys(r["method"] for r in group))
        for j, name in enumerate(("ttft", "e2e")):
            ax = axes[i][j]
            for k, side in enumerate(("vtprune", "angelslim")):
                vals = {r["method"]: r for r in group if r["side"] == side}
                xs = [m for m in methods if m in vals]
                ax.bar([methods.index(m) + (k - 0.5) * 0.38 for m in xs], [vals[m][f"{name}_ms_p50"] for m in xs],
                       width=0.36, label=side)
                dense = [vals[m][f"dense_{name}_ms_p50"] for m in xs]
                if dense:
                    ax.axhline(sorted(dense)[len(dense) // 2], color=f"C{k}", ls="--", lw=1,
                               label=f"unpruned ({side}'s transformers)")
            ax.set_xticks(range(len(methods)), methods, rotation=20, fontsize=8)
            ax.set_ylabel(f"{'time to first token' if name == 'ttft' else 'generate end to end'} (ms, p50)")
            ax.set_title(f"{group[0]['model_label'] if group else kind}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(rows: list[dict], args, worker_info: dict) -> None:
    """``peers.csv``, ``peers.md`` and ``peers.png`` in ``args.out`` (the caller checked --force)."""
    from vtprune.eval.provenance import git_state

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = {"git_sha": git_state()["git_sha"], "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    with (out / "peers.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**{c: row.get(c, "") for c in COLUMNS}, **stamp})
    (out / "peers.md").write_text(markdown(rows, conditions(args, worker_info)))
    plot(rows, out / "peers.png")


def replot(folder: Path) -> Path:
    """Redraw ``peers.png`` from the ``peers.csv`` in ``folder`` (e.g. after a change to :func:`plot`)."""
    with (Path(folder) / "peers.csv").open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for name in ("ttft", "e2e"):
            for key in (f"{name}_ms_p50", f"dense_{name}_ms_p50"):
                row[key] = float(row[key]) if row[key] else float("nan")
    plot(rows, Path(folder) / "peers.png")
    return Path(folder) / "peers.png"


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "peers.csv").is_file():
        sys.exit("usage: python -m vtprune.eval.speed.peers_report FOLDER (a folder holding peers.csv)")
    print(replot(Path(sys.argv[1])))
