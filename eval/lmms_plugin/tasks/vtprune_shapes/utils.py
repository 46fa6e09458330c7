"""Document functions of the ``vtprune_shapes`` lmms-eval task (one generated question per document).

Documents are rows of ``docs.jsonl`` written by ``vtprune bench lmms-prepare``:
``id``, ``image`` (absolute PNG path), ``question``, ``answer``, ``qtype``. Scoring is vtprune bench's exact
match (:func:`vtprune.eval.accuracy.bench.normalise` on both sides), overall and per question type.
"""

from __future__ import annotations

from typing import Any

from PIL import Image
from vtprune.eval.lmms_plugin.scoring import exact_match_metrics


def doc_to_visual(doc: dict) -> list[Image.Image]:
    """The document's image, as a one-element list."""
    with Image.open(doc["image"]) as image:
        return [image.convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """``pre_prompt + question + post_prompt`` (both empty by default: the embedded models' format)."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def process_results(doc: dict, results: list[Any]) -> dict[str, float]:
    """``exact_match`` and ``exact_match_<qtype>`` (only the document's own type; lmms-eval skips the rest)."""
    return exact_match_metrics(doc, results)
