"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.long_debias` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("long_debias", __name__)
