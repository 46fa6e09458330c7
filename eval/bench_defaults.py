"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.defaults` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_defaults", __name__)
