"""Deprecated path: moved to :mod:`vtprune.eval.training.train` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("train_tiny", __name__)
