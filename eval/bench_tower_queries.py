"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.tower_queries` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_tower_queries", __name__)
