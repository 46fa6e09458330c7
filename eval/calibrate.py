"""Deprecated path: moved to :mod:`vtprune.eval.tuning.calibrate` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("calibrate", __name__)
