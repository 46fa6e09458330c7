"""Plot the kernel benchmark CSVs: one PNG per kernel (median latency, p20-p80 whiskers, log scale).

Usage::

    vtprune bench plot-kernels [--csv runs/kernels/bench_kernels_cuda.csv ...] [--out runs/kernels]
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

IMPL_ORDER = ["torch_loop", "torch", "triton"]


NEEDED = ("kernel", "impl", "shape", "batch", "size", "dtype", "device", "device_name", "p20_ms", "p50_ms", "p80_ms")


def read_rows(paths: list[Path]) -> list[dict[str, str]]:
    """All rows of the given benchmark CSVs; a :class:`UserError` names a file that is not one."""
    from vtprune.errors import UserError

    rows: list[dict[str, str]] = []
    for path in paths:
        hint = "give a bench_kernels_*.csv that `vtprune bench kernels` wrote."
        if not path.is_file():
            raise UserError(f"--csv {str(path)!r} is {'a folder' if path.is_dir() else 'not there'}; {hint}")
        try:
            with path.open(newline="") as fh:
                reader = csv.DictReader(fh)
                missing = [column for column in NEEDED if column not in (reader.fieldnames or [])]
                if missing:
                    raise UserError(f"--csv {str(path)!r} is not a kernel benchmark CSV (no column {missing[0]!r}); "
                                    f"{hint}")
                found = list(reader)
            for row in found:
                for column in ("p20_ms", "p50_ms", "p80_ms"):
                    float(row[column])
        except (UnicodeDecodeError, csv.Error, ValueError, TypeError) as error:
            if isinstance(error, UserError):
                raise
            raise UserError(f"--csv {str(path)!r} is not a kernel benchmark CSV ({error}); {hint}") from None
        rows += found
    return rows


def plot_kernel(kernel: str, rows: list[dict[str, str]], out_dir: Path) -> Path:
    """Grouped bars: x = configuration (shape, batch, size, device), one bar per impl; returns the PNG path."""
    configs: list[str] = []
    by_impl: dict[str, dict[str, tuple[float, float, float]]] = defaultdict(dict)
    for r in rows:
        label = f"{r['shape']} B={r['batch']}\n{r['size']}\n{r['dtype']} {r['device']}"
        if label not in configs:
            configs.append(label)
        by_impl[r["impl"]][label] = (float(r["p20_ms"]), float(r["p50_ms"]), float(r["p80_ms"]))
    impls = [i for i in IMPL_ORDER if i in by_impl] + sorted(set(by_impl) - set(IMPL_ORDER))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(configs) + 2), 4.8))
    for j, impl in enumerate(impls):
        xs, med, lo, hi = [], [], [], []
        for x, label in enumerate(configs):
            if label in by_impl[impl]:
                p20, p50, p80 = by_impl[impl][label]
                xs.append(x + (j - (len(impls) - 1) / 2) * width)
                med.append(p50)
                lo.append(p50 - p20)
                hi.append(p80 - p50)
        ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=impl)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, p50; whiskers p20-p80)")
    device_names = sorted({r["device_name"] for r in rows})
    ax.set_title(f"vtprune.kernels: {kernel}  ({'; '.join(device_names)})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"kernels_{kernel}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    """Render one PNG per kernel found in the CSVs; return their paths."""
    from vtprune.cli.checks import OneLineParser, check_output_dir

    p = OneLineParser(prog="vtprune bench plot-kernels", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", type=Path, nargs="+", default=None, help="default: <out>/bench_kernels_*.csv")
    p.add_argument("--out", type=Path, default=Path("runs/kernels"),
                   help="folder of the CSVs and the plots (default: runs/kernels)")
    args = p.parse_args(argv)
    paths = args.csv or sorted(args.out.glob("bench_kernels_*.csv"))
    try:
        check_output_dir(args.out)
        if not paths:
            raise ValueError(f"--out {str(args.out)!r} holds no bench_kernels_*.csv and no --csv is given; run "
                             "`vtprune bench kernels` first.")
        rows = read_rows(paths)
        if not rows:
            raise ValueError(f"{', '.join(map(str, paths))}: no benchmark rows to plot; run `vtprune bench kernels`.")
    except ValueError as error:
        p.error(str(error))
    kernels = sorted({r["kernel"] for r in rows})
    pngs = [
        plot_kernel(k, [r for r in rows if r["kernel"] == k], args.out) for k in tqdm(kernels, desc="plot")
    ]
    for png in pngs:
        print(f"wrote {png}")
    return pngs


if __name__ == "__main__":
    main()
