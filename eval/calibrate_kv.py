"""Deprecated path: moved to :mod:`vtprune.eval.tuning.calibrate_kv` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("calibrate_kv", __name__)
