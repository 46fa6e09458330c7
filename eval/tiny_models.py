"""Deprecated path: moved to :mod:`vtprune.eval.training.models` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tiny_models", __name__)
