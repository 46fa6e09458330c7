"""Deprecated path: moved to :mod:`vtprune.eval.kernels.bench` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_kernels", __name__)
