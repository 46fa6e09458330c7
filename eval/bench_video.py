"""Deprecated path: moved to :mod:`vtprune.eval.accuracy.video` (kept for one release; see CHANGELOG.md)."""

from vtprune.eval._moved import alias

alias("bench_video", __name__)
