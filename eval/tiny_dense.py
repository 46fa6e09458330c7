"""Deprecated path: moved to :mod:`vtprune.eval.training.dense` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tiny_dense", __name__)
