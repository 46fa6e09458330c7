"""Deprecated path: moved to :mod:`vtprune.eval.papers.table` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("reproduce_table", __name__)
