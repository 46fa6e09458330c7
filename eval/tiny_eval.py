"""Deprecated path: moved to :mod:`vtprune.eval.training.evaluate` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tiny_eval", __name__)
