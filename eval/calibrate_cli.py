"""Deprecated path: moved to :mod:`vtprune.eval.tuning.calibrate_cli` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("calibrate_cli", __name__)
