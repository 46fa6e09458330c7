"""Deprecated path: moved to :mod:`vtprune.eval.speed.bench` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_speed", __name__)
