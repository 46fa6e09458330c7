"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.long` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_long", __name__)
