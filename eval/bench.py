"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.bench` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench", __name__)
