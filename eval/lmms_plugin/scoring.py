"""Exact-match scoring shared by the local vtprune-shapes lmms-eval tasks (same rule as ``vtprune bench``)."""

from __future__ import annotations

from typing import Any


def normalise(text: str) -> str:
    """vtprune bench's answer normalisation (lower case, no trailing period, spaces to hyphens)."""
    from vtprune.eval.accuracy.bench import normalise as bench_normalise

    return bench_normalise(text)


def exact_match_metrics(doc: dict, results: list[Any]) -> dict[str, float]:
    """``{"exact_match": x, "exact_match_<qtype>": x}`` for one document and its first response.

    Documents of other question types simply do not report ``exact_match_<qtype>``; lmms-eval aggregates
    each metric over the documents that returned it (also across ranks), so per-type means are exact.
    """
    response = results[0] if results else ""
    correct = float(normalise(str(response)) == normalise(str(doc["answer"])))
    return {"exact_match": correct, f"exact_match_{doc['qtype']}": correct}
