"""Markdown table and PNG plots of a ``vtprune bench --speed`` CSV.

Usage (regenerate from a CSV, e.g. after a run was cut short; ``--merge`` first concatenates split runs)::

    vtprune bench speed-report docs/results/speed-proxy [--max-spread 1.25] [--merge a.csv b.csv]

Writes ``speed.md`` (one line per geometry x batch x method x keep, hook overhead and sync summary,
conditions), ``speedup_vs_keep.png`` (measured vs FLOP-predicted speedup of prefill, decode and end to end,
one row of panels per batch size) and ``memory_vs_visual.png`` (peak memory and KV-cache bytes vs visual
tokens per sample).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

PARTS = ("prefill", "decode", "e2e")
# the columns of a speed CSV (vtprune.eval.speed.bench.COLUMNS) that the report reads
READ = ("geometry", "family", "batch", "visual_tokens", "method", "keep", "status", "spread_ok", "e2e_ms_p20",
        "e2e_ms_p50", "e2e_ms_p80", "e2e_base_ms_p50", "prefill_base_ms_p50", "decode_base_ms_p50", "decode_ms_p50",
        *(f"{kind}_{part}" for kind in ("speedup", "predicted") for part in PARTS), "throughput", "kv_bytes",
        "kv_bytes_predicted", "peak_mem_mb", "hook_overhead_us", "hook_overhead_pct", "hook_time_decode_us",
        "hook_time_decode_pct", "syncs_prefill_hooks", "syncs_decode_hooks", "syncs_prefill_delta",
        "syncs_decode_delta", "sync_ops_hooks", "lm_hidden", "lm_layers", "lm_heads", "lm_kv_heads",
        "lm_intermediate", "lm_vocab", "git_sha", "weights_sha", "date")


def read_rows(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return list(csv.DictReader(f))


def check_speed_csv(path: Path, flag: str) -> list[str]:
    """The columns of the speed CSV at ``path``; a :class:`UserError` naming it when it is not one (no rows read)."""
    from vtprune.errors import UserError

    path = Path(path)
    if not path.is_file():
        what = "a folder" if path.is_dir() else "not there"
        raise UserError(f"{flag} {str(path)!r} is {what}; give the speed.csv a `vtprune bench --speed` run wrote.")
    try:
        with path.open(newline="") as f:
            fields = next(csv.reader(f), [])
    except (UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"{flag} {str(path)!r} is not a CSV file ({error}); give the speed.csv of a "
                        "`vtprune bench --speed` run.") from None
    missing = [column for column in READ if column not in fields]
    if missing:
        raise UserError(f"{flag} {str(path)!r} is not a speed CSV of this vtprune (no column {missing[0]!r}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); give the speed.csv of a "
                        "`vtprune bench --speed` run.")
    return fields


def _f(value, default: float = float("nan")) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _x(row: dict, part: str) -> str:
    measured, predicted = _f(row[f"speedup_{part}"]), _f(row[f"predicted_{part}"])
    return "n/a" if measured != measured else f"{measured:.2f}x ({predicted:.2f}x)"


def _e2e(row: dict) -> str:
    from vtprune.eval.speed.measure import split_prediction

    measured = _f(row["speedup_e2e"])
    if measured != measured:
        return "n/a"
    split = split_prediction(_f(row["e2e_base_ms_p50"]), _f(row["prefill_base_ms_p50"]), _f(row["predicted_prefill"]),
                             _f(row["predicted_decode"]))
    return f"{measured:.2f}x ({_f(row['predicted_e2e']):.2f}x / {split:.2f}x)"


def _mb(value) -> str:
    number = _f(value)
    return "n/a" if number != number else f"{number / 2**20:.1f}"


def markdown(rows: list[dict], max_spread: float = 1.25) -> str:
    """The report: main table, hook overhead and syncs per method, flagged spreads, conditions."""
    lines = [
        "| geometry | batch | method | keep | e2e ms p50 [p20-p80] | end to end (FLOP pred. / split pred.) | prefill (pred.) | "
        "decode (pred.) | decode ms/token | hook µs/step (% of step) | KV MB (pred.) | peak MB | samples/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    flagged = 0
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['geometry']} | {r['batch']} | {r['method']} | {_f(r['keep']):g} | {r['status']} "
                         "| | | | | | | | |")
            continue
        mark = "" if r["spread_ok"] == "True" else " †"
        flagged += bool(mark)
        hook = "" if r["method"] == "none" else f"{_f(r['hook_time_decode_us']):.0f} ({_f(r['hook_time_decode_pct']):.2f}%)"
        lines.append(
            f"| {r['geometry']} | {r['batch']} | {r['method']} | {_f(r['keep']):g} | {_f(r['e2e_ms_p50']):.1f} "
            f"[{_f(r['e2e_ms_p20']):.1f}-{_f(r['e2e_ms_p80']):.1f}]{mark} | {_e2e(r)} | {_x(r, 'prefill')} | "
            f"{_x(r, 'decode')} | {_f(r['decode_ms_p50']):.2f} | {hook} | {_mb(r['kv_bytes'])} "
            f"({_mb(r['kv_bytes_predicted'])}) | {r['peak_mem_mb'] or 'n/a'} | {_f(r['throughput']):.3f} |")
    lines += ["", *overhead_table(rows), "", *notes(rows, max_spread, flagged), "", conditions_line(rows)]
    return "\n".join(lines) + "\n"


def overhead_table(rows: list[dict]) -> list[str]:
    """Per geometry x batch x method at keep 1.0: decode-step overhead (difference and inside hooks), syncs."""
    lines = ["Hook cost per decode step (method at keep 1.0 vs the unwrapped model) and host syncs:", "",
             "| geometry | batch | method | decode step ms (unwrapped) | overhead µs (%) | inside hooks µs (%) | "
             "syncs in hooks: prefill / decode step | whole call minus unwrapped: prefill / decode step | "
             "ops in hooks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] == "none" or _f(r["keep"]) != 1.0 or r["status"] != "ok":
            continue
        lines.append(
            f"| {r['geometry']} | {r['batch']} | {r['method']} | {_f(r['decode_base_ms_p50']):.2f} | "
            f"{_f(r['hook_overhead_us']):.0f} ({_f(r['hook_overhead_pct']):.2f}%) | "
            f"{_f(r['hook_time_decode_us']):.0f} ({_f(r['hook_time_decode_pct']):.2f}%) | "
            f"{r['syncs_prefill_hooks']} / {r['syncs_decode_hooks']} | {r['syncs_prefill_delta']} / "
            f"{r['syncs_decode_delta']} | {r['sync_ops_hooks'] or '-'} |")
    return lines


def notes(rows: list[dict], max_spread: float, flagged: int) -> list[str]:
    first = rows[0]
    shared = " on a shared machine" if first["device"].startswith("cpu") else ""
    out = [f"Timings{shared} are noisy: p20-p80 over {first['repeats']} round-robin repeats after a warm-up. "
           f"† marks the {flagged} row(s) whose p80/p20 (baseline or pruned, end to end) exceeds {max_spread:g}: "
           "their speedups are within the noise."]
    out.append("Speedups are p50 ratios; (pred.) is the FLOP-predicted ratio on the padded per-layer lengths "
               "(vision tower excluded); split pred. applies the prefill and decode predictions to the baseline's "
               "measured prefill / rest split (decode steps cost far more time per FLOP than prefill, so the pure "
               "FLOP ratio overstates the end-to-end gain). Decode = mean generate step after the first token. "
               "Overhead = decode "
               "step p50 at keep 1.0 minus the unwrapped p50 (noisy when small); inside hooks = host time "
               "measured in vtprune's hooks. KV = bytes of the cache tensors after generate (prompt + new "
               "tokens - 1). Peak memory: " + (first.get("mem_method") or "n/a") + ".")
    return out


def conditions_line(rows: list[dict]) -> str:
    first = rows[0]
    families = {}
    for r in rows:
        families.setdefault(r["family"], r)
    lms = "; ".join(f"{fam}: hidden {r['lm_hidden']}, {r['lm_layers']} layers, {r['lm_heads']}/{r['lm_kv_heads']} "
                    f"heads, MLP {r['lm_intermediate']}, vocab {r['lm_vocab']}, weights {r['weights_sha']}"
                    for fam, r in families.items())
    shas = list(dict.fromkeys(f"{r['git_sha']}{' (dirty tree)' if r.get('git_dirty') == 'True' else ''}"
                              for r in rows))
    dates = ", ".join(dict.fromkeys(r["date"] for r in rows))
    return (f"Conditions: random-weight speed proxies ({first['lm']} LM; {lms}), {first['new_tokens']} new tokens, "
            f"device {first['device']} ({first['threads']} thread{'' if str(first['threads']) == '1' else 's'}), dtype {first['dtype']}, attention "
            f"{first['attn_implementation']}, torch {first['torch']}, transformers {first['transformers']}, "
            f"vtprune {first['vtprune']} @ {', '.join(shas)} (per row in the CSV), {dates}.")


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``speedup_vs_keep.png`` and ``memory_vs_visual.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["method"] != "none"]
    batches = sorted({int(r["batch"]) for r in ok})
    if not ok:
        return []
    series = defaultdict(list)
    for r in ok:
        series[(r["geometry"], r["method"], int(r["batch"]))].append(r)
    geometries = list(dict.fromkeys(r["geometry"] for r in ok))
    methods = list(dict.fromkeys(r["method"] for r in ok))
    colors = {g: f"C{i}" for i, g in enumerate(geometries)}
    styles = {m: s for m, s in zip(methods, ("-", "--", "-.", ":") * 4)}
    fig, axes = plt.subplots(len(batches), 3, figsize=(15, 4.2 * len(batches)), squeeze=False)
    for row_index, batch in enumerate(batches):
        for col, part in enumerate(PARTS):
            ax = axes[row_index][col]
            for (geometry, method, b), points in series.items():
                if b != batch:
                    continue
                points = sorted(points, key=lambda r: _f(r["keep"]))
                keeps = [_f(r["keep"]) for r in points]
                ax.plot(keeps, [_f(r[f"speedup_{part}"]) for r in points], styles[method], marker="o",
                        color=colors[geometry], label=f"{geometry} {method}")
                ax.plot(keeps, [_f(r[f"predicted_{part}"]) for r in points], styles[method], color=colors[geometry],
                        alpha=0.3, linewidth=3)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_title(f"{part} speedup, batch {batch} (faint: FLOP-predicted)")
            ax.set_xlabel("keep fraction")
            ax.set_ylabel("baseline / pruned (p50)")
            ax.invert_xaxis()
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths = [out / "speedup_vs_keep.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    paths.append(_plot_memory(rows, out, plt))
    return paths


def _plot_memory(rows: list[dict], out: Path, plt) -> Path:
    batches = sorted({int(r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        chosen = [r for r in rows if int(r["batch"]) == batch and r["status"] == "ok"
                  and (r["method"] == "none" or abs(_f(r["keep"]) - 0.25) < 1e-9)]
        groups = defaultdict(list)
        for r in chosen:
            groups[r["method"]].append(r)
        for i, (method, points) in enumerate(groups.items()):
            points = sorted(points, key=lambda r: int(r["visual_tokens"]))
            x = [int(r["visual_tokens"]) for r in points]
            label = "unpruned" if method == "none" else f"{method} keep 0.25"
            peaks = [_f(r["peak_mem_mb"]) for r in points]
            if any(p == p for p in peaks):
                ax.plot(x, peaks, "-o", color=f"C{i}", label=f"peak, {label}")
            ax.plot(x, [_f(r["kv_bytes"]) / 2**20 for r in points], "--s", color=f"C{i}", label=f"KV cache, {label}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("visual tokens per sample (batch-1 geometry)")
        ax.set_ylabel("MB")
        ax.set_title(f"memory of one generate call, batch {batch}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "memory_vs_visual.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(csv_path: Path, out: Path, max_spread: float = 1.25) -> None:
    """``speed.md`` and the plots for the CSV at ``csv_path``."""
    rows = read_rows(csv_path)
    if not rows:
        return
    (Path(out) / "speed.md").write_text(markdown(rows, max_spread))
    plot(rows, Path(out))


def merge_csvs(paths: list[Path], target: Path) -> None:
    """Concatenate speed CSVs (runs split by geometry or batch) into ``target``."""
    rows: list[dict] = []
    fields: list[str] | None = None
    for path in paths:
        with Path(path).open() as f:
            reader = csv.DictReader(f)
            if fields is not None and reader.fieldnames != fields:
                from vtprune.errors import UserError

                raise UserError(f"--merge {str(path)!r}: its columns differ from {str(paths[0])!r}; rerun both with "
                                "the same vtprune.")
            fields = list(reader.fieldnames or [])
            rows += list(reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or [])
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    from vtprune.cli.checks import OneLineParser, check_output_dir, number_range

    parser = OneLineParser(prog="vtprune bench speed-report", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="folder holding speed.csv (outputs land there)")
    parser.add_argument("--max-spread", type=number_range(1.0), default=1.25,
                        help="flag rows whose p80/p20 exceeds this, >= 1 (default 1.25)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="first concatenate these speed.csv files (same columns) into <folder>/speed.csv")
    parser.add_argument("--force", action="store_true",
                        help="with --merge: replace a speed.csv already in the folder that is not one of the merged "
                             "files (default: refuse)")
    args = parser.parse_args(argv)
    path = args.folder / "speed.csv"
    try:
        check_output_dir(args.folder, "folder")
        if args.merge:
            for given in args.merge:
                check_speed_csv(given, "--merge")
            merged = {given.resolve() for given in args.merge}
            if path.exists() and path.resolve() not in merged and not args.force:
                raise ValueError(f"{str(path)!r} already exists and is not one of the --merge files; give another "
                                 "folder, add it to --merge, or --force to replace it.")
            merge_csvs(args.merge, path)
        elif not path.exists():
            raise ValueError(f"{str(path)!r} does not exist; run 'vtprune bench --speed --out {args.folder}' first.")
        check_speed_csv(path, "folder")
    except ValueError as error:
        parser.error(str(error))
    write_report(path, args.folder, args.max_spread)
    print(f"wrote {args.folder / 'speed.md'} and plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
