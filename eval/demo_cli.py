"""Deprecated path: moved to :mod:`vtprune.demo.cli` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("demo_cli", __name__)
