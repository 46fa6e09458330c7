"""Document functions of the ``vtprune_shapes`` lmms-eval task (one generated question per document).

Documents are rows of ``docs.jsonl`` written by ``vtprune bench lmms-prepare``:
``id``, ``image`` (absolute PNG path), ``question``, ``answer``, ``qtype``. Scoring is vtprune bench's exact
match (:func:`vtprune.eval.accuracy.bench.normalise` on both sides), overall and per question type.
"""

from __future__ import annotations

from typing import Any

from vtprune.eval.lmms_plugin.documents import doc_to_text, doc_to_visual  # noqa: F401 (the YAML's)
from vtprune.eval.lmms_plugin.scoring import exact_match_metrics


def process_results(doc: dict, results: list[Any]) -> dict[str, float]:
    """``exact_match`` and ``exact_match_<qtype>`` (only the document's own type; lmms-eval skips the rest)."""
    return exact_match_metrics(doc, results)
