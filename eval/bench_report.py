"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.report` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_report", __name__)
