"""Deprecated path: moved to :mod:`vtprune.eval.tuning.spaces` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tune_spaces", __name__)
