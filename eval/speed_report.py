"""Deprecated path: moved to :mod:`vtprune.eval.speed.report` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("speed_report", __name__)
