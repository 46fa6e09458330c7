"""Deprecated path: moved to :mod:`vtprune.eval.speed.syncs` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("syncs", __name__)
