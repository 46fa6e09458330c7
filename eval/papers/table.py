"""The table of :mod:`vtprune.eval.papers.reproduce`: each paper number beside the measured one, the difference, and
the speed of the run that measured it (wall clock, prefill per sample and its ratio to the unpruned run)."""

from __future__ import annotations

import csv
import platform
from pathlib import Path
from typing import Any

from vtprune.eval.papers.data import RELATIVE, PaperRow, Setting, metric, row_setting
from vtprune.eval.papers.protocols import method_args, protocol_note

COLUMNS = ["model", "paper", "method", "keep", "options", "tokens", "benchmark", "paper_value", "measured",
           "difference", "measured_lmms_eval", "visual_tokens", "kept_tokens", "wall_s", "generate_s",
           "generate_speedup", "prefill_ms_per_sample", "prefill_speedup", "protocol", "source", "note"]


def measured(row: PaperRow, runs: dict[Setting, dict[str, Any]], dry_run: bool, mmbench: str = "judge",
             lmms_way: bool = False) -> float | None:
    """The measured counterpart of a paper number (a relative score: pruned / unpruned of the same model, %).

    ``lmms_way``: lmms-eval's own number for the same answers where the papers score differently (POPE's pooled
    F1), None elsewhere.
    """
    setting = row_setting(row)
    run = runs.get(setting) if setting is not None else None
    if run is None:
        return None
    if row.benchmark not in RELATIVE:
        return metric(run["results"], row.benchmark, dry_run, row.model, mmbench, lmms_way, row.options)
    base = runs.get(Setting(row.model, "none", 1.0))
    if base is None or lmms_way:
        return None
    ratios = []
    for name in RELATIVE[row.benchmark]:
        pruned = metric(run["results"], name, dry_run, row.model, mmbench, options=row.options)
        full = metric(base["results"], name, dry_run, row.model, mmbench, options=row.options)
        if pruned is None or not full:
            return None
        ratios.append(pruned / full)
    return 100 * sum(ratios) / len(ratios)


def _throughput(run: dict[str, Any] | None, key: str) -> float | None:
    """A number of the results file's ``throughput`` block (``avg_vtprune_*`` or lmms-eval's own); None if NaN."""
    block = ((run or {}).get("results") or {}).get("throughput", {})
    value = block.get(key, block.get(f"avg_vtprune_{key}"))
    return float(value) if isinstance(value, int | float) and value == value else None


def _speedup(base: float | None, run: float | None) -> float | None:
    return base / run if base and run else None


def table(rows: list[PaperRow], runs: dict[Setting, dict[str, Any]], dry_run: bool,
          mmbench: str = "judge") -> list[dict[str, Any]]:
    """One line per paper number, in the data file's order, with the known protocol differences of its run."""
    lines = []
    for row in rows:
        setting = row_setting(row)
        run = runs.get(setting) if setting else None
        base = runs.get(Setting(row.model, "none", 1.0))
        value = measured(row, runs, dry_run, mmbench)
        protocol = protocol_note(row, mmbench)
        if dry_run and setting is not None and method_args(setting, True)[1]:
            protocol = "; ".join(filter(None, [protocol, method_args(setting, True)[1]]))
        prefill, base_prefill = _throughput(run, "prefill_ms_per_sample"), _throughput(base, "prefill_ms_per_sample")
        generate, base_generate = _throughput(run, "total_elapsed_time"), _throughput(base, "total_elapsed_time")
        note = row.note if run is not None or row.keep is None else "; ".join(filter(None, [row.note, "not run"]))
        lines.append({
            "model": row.model, "paper": row.paper, "method": row.method,
            "keep": "" if row.keep is None else f"{row.keep:g}", "options": row.options, "tokens": row.tokens,
            "benchmark": row.benchmark, "paper_value": row.value, "measured": value,
            "difference": None if value is None or row.value is None else value - row.value,
            "measured_lmms_eval": measured(row, runs, dry_run, mmbench, lmms_way=True),
            "visual_tokens": _throughput(run, "visual_tokens") or None,  # 0: nothing recorded (no pruning)
            "kept_tokens": _throughput(run, "kept_tokens") if _throughput(run, "visual_tokens") else None,
            "wall_s": run["wall_s"] if run else None, "generate_s": generate,
            "generate_speedup": _speedup(base_generate, generate), "prefill_ms_per_sample": prefill,
            "prefill_speedup": _speedup(base_prefill, prefill),
            "protocol": protocol, "source": row.source, "note": note,
        })
    return lines


def _cell(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _with_speedup(value: float | None, speedup: float | None) -> str:
    """``12.3 (1.45x)``; the speedup is the unpruned run's value over this run's."""
    if value is None:
        return ""
    return f"{value:.2f}" + (f" ({speedup:.2f}x)" if speedup else "")


def markdown(lines: list[dict[str, Any]], conditions: dict[str, str], dry_run: bool) -> str:
    """``table.md``: a banner for the dry run, the conditions, one table per model, the sources."""
    out = ["# Papers' numbers beside vtprune's", ""]
    if dry_run:
        out += ["**DRY RUN**: the embedded models on the local `vtprune_shapes` task stand in for the checkpoints "
                "and every benchmark; the measured column shows that the pipeline runs and is *not* comparable to "
                "the papers' numbers.", ""]
    out += ["Conditions: " + ", ".join(f"{k} {v}" for k, v in conditions.items()) + ".", "",
            "*run wall s*: the whole lmms-eval run (loading, data, generation, scoring); *generate s*: lmms-eval's "
            "generation time summed over the run's batches; *prefill ms/sample*: vtprune's measured prefill (vision "
            "tower + LM prompt forward) per sample; speedups are the unpruned run's time over this run's, on the same "
            "documents. *lmms-eval's way*: lmms-eval's own score of the same answers where the papers score "
            "differently (POPE: F1 pooled over the splits, exact 'yes' only; the *measured* column is the papers' "
            "F1, per split then averaged). Each source note ends with the run's known protocol differences.", ""]
    head = ["paper", "method", "keep", "tokens", "benchmark", "paper", "measured", "diff", "lmms-eval's way",
            "visual → kept",
            "run wall s", "generate s (speedup)", "prefill ms/sample (speedup)"]
    sources: dict[str, int] = {}
    for model in dict.fromkeys(line["model"] for line in lines):
        out += [f"## {model}", "", "| " + " | ".join(head) + " | [source] |", "|" + "---|" * (len(head) + 1)]
        for line in (x for x in lines if x["model"] == model):
            text = line["source"] + (f" ({line['note']})" if line["note"] else "")
            text += f". Protocol: {line['protocol']}" if line["protocol"] else ""
            ref = sources.setdefault(text, len(sources) + 1)
            tokens = (f"{line['visual_tokens']:.0f} → {line['kept_tokens']:.0f}"
                      if line["visual_tokens"] is not None and line["kept_tokens"] is not None else "")
            keep = line["keep"] + (f" ({line['options']})" if line["options"] else "")
            cells = [line["paper"], f"`{line['method']}`", keep, str(line["tokens"]), line["benchmark"],
                     _cell(line["paper_value"]), _cell(line["measured"]), _cell(line["difference"]),
                     _cell(line["measured_lmms_eval"]), tokens,
                     _cell(line["wall_s"], 0), _with_speedup(line["generate_s"], line["generate_speedup"]),
                     _with_speedup(line["prefill_ms_per_sample"], line["prefill_speedup"])]
            out.append("| " + " | ".join(cells) + f" | [{ref}] |")
        out.append("")
    out += ["## Sources", ""] + [f"{n}. {text}" for text, n in sources.items()]
    return "\n".join(out) + "\n"


def write(lines: list[dict[str, Any]], folder: Path, conditions: dict[str, str], dry_run: bool) -> Path:
    """Write ``table.csv`` (every column, conditions appended) and ``table.md``; returns the Markdown path."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "table.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS + list(conditions))
        writer.writeheader()
        writer.writerows({**line, **conditions} for line in lines)
    (folder / "table.md").write_text(markdown(lines, conditions, dry_run))
    return folder / "table.md"


def conditions(dry_run: bool, batch_size: int, limit: int | None, launcher: str,
               mmbench: str = "judge") -> dict[str, str]:
    """Device, versions, git SHA and the run settings, for every row of the table."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers
    from vtprune.eval.provenance import git_state

    import vtprune

    try:
        lmms = version("lmms-eval")
    except PackageNotFoundError:
        lmms = "missing"
    device = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() and not dry_run
              else f"cpu ({platform.machine()})")
    git = git_state()
    return {"mode": "dry run" if dry_run else "checkpoints", "device": device, "batch_size": str(batch_size),
            "limit": str(limit) if limit else "all", "launcher": launcher, "mmbench": mmbench, "torch": torch.__version__,
            "transformers": transformers.__version__, "lmms_eval": str(lmms), "vtprune": vtprune.__version__,
            "git_sha": str(git["git_sha"]), "git_dirty": str(git["git_dirty"])}
