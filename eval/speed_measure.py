"""Deprecated path: moved to :mod:`vtprune.eval.speed.measure` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("speed_measure", __name__)
