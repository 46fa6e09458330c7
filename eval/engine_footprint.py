"""Deprecated path: moved to :mod:`vtprune.eval.speed.footprint` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("engine_footprint", __name__)
