"""Micro-benchmarks of the kernels in ``vtprune.kernels`` (Triton vs their torch twins): ``vtprune bench
kernels`` and ``vtprune bench plot-kernels``."""
