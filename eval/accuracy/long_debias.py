"""Is there a recency trend at 256-512 visual tokens? A summary of ``vtprune calibrate`` files.

``vtprune calibrate`` fits ``log a = log mu + sigma x`` on every (token, prompt) pair; attention is sparse,
so that per-token fit has a low r^2 even when the mean attention clearly rises along the sequence. This
module reads the stored 32-bin mean curve as well and reports, per scoring layer: the per-token ``sigma`` and
``r^2``, the slope and r^2 of the same log-linear fit on the bin means (weighted by their counts), and the
ratio of the mean attention of the last quarter of the visual tokens to that of the first quarter (1 = no
trend). ``--curve DIR`` also writes each file with ``"trend": "curve"`` (debias by the binned curve, a
piecewise-linear table, instead of the exponential) for ``bench_long --debias-file``.

    vtprune bench long-debias runs/long/cal/*.json --out docs/results/long-debias/trend.md
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def binned_trend(curve: dict) -> dict[str, float]:
    """Slope and r^2 of ``log mean ~ x`` over the bins (count-weighted), and last / first quarter mean ratio."""
    x, mean, count = (np.asarray(curve[k], np.float64) for k in ("x", "mean", "count"))
    ok = (count > 0) & (mean > 0)
    x, y, w = x[ok], np.log(mean[ok]), count[ok]
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    slope = float(np.sum(w * (x - xm) * (y - ym)) / np.sum(w * (x - xm) ** 2))
    residual = y - (ym + slope * (x - xm))
    total = float(np.sum(w * (y - ym) ** 2))
    r2 = 1.0 - float(np.sum(w * residual ** 2)) / total if total > 0 else float("nan")  # flat: undefined
    first, last = x < 0.25, x >= 0.75
    ratio = float(np.average(mean[ok][last], weights=w[last]) / np.average(mean[ok][first], weights=w[first]))
    return {"binned_sigma": slope, "binned_r2": r2, "last_first_ratio": ratio}


def read_fit(path: Path) -> dict:
    """A ``vtprune calibrate`` file, checked (:func:`load_calibration_json`) and holding what the summary reads:
    ``method``, ``n_samples`` and, per layer, ``r2`` and a ``curve`` with ``count``; UserError naming the field."""
    from vtprune.calibration_check import load_calibration_json
    from vtprune.errors import UserError
    from vtprune.methods.debias import FORMAT

    data = load_calibration_json(path, FORMAT)
    fields = ["method", "n_samples"] + [f"layers.{k}.{f}" for k in data["layers"] for f in ("sigma", "r2", "curve")]
    for field in fields:
        value = data
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None or (field.endswith("curve") and "count" not in value):
            raise UserError(f"calibration file {str(path)!r}: field {field!r} is missing or incomplete; long_debias "
                            "summarises files written by `vtprune calibrate`.")
    return data


def summary_rows(paths: list[Path]) -> list[dict]:
    """One row per file x scoring layer."""
    rows = []
    for path in paths:
        data = read_fit(path)
        for layer, entry in sorted(data["layers"].items(), key=lambda kv: int(kv[0])):
            rows.append({"file": Path(path).name, "model": data.get("model", ""), "data": data.get("data", "calib images"),
                         "method": data["method"], "score_layer": int(layer), "n_samples": data["n_samples"],
                         "sigma": entry["sigma"], "r2": entry["r2"], **binned_trend(entry["curve"])})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | prompts | host | score layer | sigma (per token) | r^2 | sigma (bin means) | r^2 (bin means) "
             "| last / first quarter |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['n_samples']} x {r['data']} | {r['method']} | {r['score_layer']} | "
                     f"{r['sigma']:.3f} | {r['r2']:.3f} | {r['binned_sigma']:.3f} | {r['binned_r2']:.3f} | "
                     f"{r['last_first_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def write_curve_copy(path: Path, folder: Path) -> Path:
    """``path`` with ``"trend": "curve"`` in ``folder`` (same name, ``-curve`` suffix)."""
    data = json.loads(Path(path).read_text())
    data["trend"] = "curve"
    out = folder / f"{Path(path).stem}-curve.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """Print (and write) the summary; a bad file or path is one ``error:`` line and exit status 2."""
    from vtprune.cli import run_reporting_errors
    from vtprune.cli.checks import OneLineParser

    parser = OneLineParser(prog="vtprune bench long-debias", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="calibration JSON files")
    parser.add_argument("--out", type=Path, default=None, help="Markdown file (default: print)")
    parser.add_argument("--curve", type=Path, default=None, help="folder for the trend=curve copies")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out file or curve copies (default: refuse)")
    args = parser.parse_args(argv)
    return run_reporting_errors(lambda: summarise(args), "long_debias")


def summarise(args: argparse.Namespace) -> int:
    """The work of :func:`main` on parsed arguments."""
    from vtprune.cli.checks import check_output_dir, check_output_file
    from vtprune.cli.outputs import check_new_file, check_new_results

    if args.out:
        check_new_file(check_output_file(args.out), args.force)
    if args.curve:
        copies = [f"{Path(path).stem}-curve.json" for path in args.files]
        check_new_results(check_output_dir(args.curve, "--curve"), copies, args.force, "--curve")
    text = markdown(summary_rows(args.files))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    if args.curve:
        args.curve.mkdir(parents=True, exist_ok=True)
        for path in args.files:
            print(f"wrote {write_curve_copy(path, args.curve)}")
    return 0 if all(math.isfinite(r["sigma"]) for r in summary_rows(args.files)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
