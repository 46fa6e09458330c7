"""Evaluation, benchmarks and training of the embedded models (installed as ``vtprune.eval``)."""
