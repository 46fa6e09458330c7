"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.long_report` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("long_report", __name__)
