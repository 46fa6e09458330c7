"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.long_items` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("long_items", __name__)
