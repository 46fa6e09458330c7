"""Deprecated path: moved to :mod:`vtprune.eval.tuning.tune` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tune", __name__)
