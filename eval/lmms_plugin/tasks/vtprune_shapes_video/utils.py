"""Document functions of the ``vtprune_shapes_video`` lmms-eval task (multiple-choice questions about clips).

Documents are rows of ``docs.jsonl`` written by ``vtprune bench lmms-prepare``: ``id``,
``frames`` (absolute PNG paths, in time order), ``question`` (with its A-D options), ``answer`` (a letter),
``qtype`` (``color`` / ``shape``), ``evidence_frames``.
"""

from __future__ import annotations

from typing import Any

from vtprune.eval.lmms_plugin.documents import doc_to_text, doc_to_visual  # noqa: F401 (the YAML's)
from vtprune.eval.lmms_plugin.scoring import exact_match_metrics


def process_results(doc: dict, results: list[Any]) -> dict[str, float]:
    """``exact_match`` on the option letter, overall and as ``exact_match_<qtype>``."""
    return exact_match_metrics(doc, results)
