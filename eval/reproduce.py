"""Deprecated path: moved to :mod:`vtprune.eval.papers.reproduce` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("reproduce", __name__)
