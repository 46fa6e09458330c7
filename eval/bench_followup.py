"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.followup` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_followup", __name__)
