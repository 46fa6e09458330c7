"""Deprecated path: moved to :mod:`vtprune.eval.training.qwen` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("tiny_qwen", __name__)
