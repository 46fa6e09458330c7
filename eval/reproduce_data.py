"""Deprecated path: moved to :mod:`vtprune.eval.papers.data` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("reproduce_data", __name__)
