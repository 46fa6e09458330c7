"""Deprecated path: moved to :mod:`vtprune.eval.speed.rows` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("speed_rows", __name__)
