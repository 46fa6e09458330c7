"""Deprecated path: moved to :mod:`vtprune.eval.speed.proxy` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("speed_proxy", __name__)
