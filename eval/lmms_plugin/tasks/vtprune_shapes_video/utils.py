"""Document functions of the ``vtprune_shapes_video`` lmms-eval task (multiple-choice questions about clips).

Documents are rows of ``docs.jsonl`` written by ``vtprune bench lmms-prepare``: ``id``,
``frames`` (absolute PNG paths, in time order), ``question`` (with its A-D options), ``answer`` (a letter),
``qtype`` (``color`` / ``shape``), ``evidence_frames``.
"""

from __future__ import annotations

from typing import Any

from PIL import Image
from vtprune.eval.lmms_plugin.scoring import exact_match_metrics


def doc_to_visual(doc: dict) -> list[Image.Image]:
    """The clip's frames as PIL images, in time order."""
    frames = []
    for path in doc["frames"]:
        with Image.open(path) as image:
            frames.append(image.convert("RGB"))
    return frames


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """``pre_prompt + question + post_prompt``; the question already lists the options and asks for a letter."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def process_results(doc: dict, results: list[Any]) -> dict[str, float]:
    """``exact_match`` on the option letter, overall and as ``exact_match_<qtype>``."""
    return exact_match_metrics(doc, results)
