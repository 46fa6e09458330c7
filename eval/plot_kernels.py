"""Deprecated path: moved to :mod:`vtprune.eval.kernels.plot` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("plot_kernels", __name__)
