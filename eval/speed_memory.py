"""Deprecated path: moved to :mod:`vtprune.eval.speed.memory` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("speed_memory", __name__)
