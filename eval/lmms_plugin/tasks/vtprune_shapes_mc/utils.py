"""Document functions of the ``vtprune_shapes_mc`` lmms-eval task: ``multiple_choice`` over loglikelihoods.

Documents are the ``vtprune_shapes`` questions whose answer comes from a closed set (colour, shape, count,
yes/no, quadrant; ``read`` questions are left out), written by ``vtprune bench lmms-prepare``.
lmms-eval sends one ``loglikelihood`` request per choice (``" " + choice`` after the question) and scores the
argmin of the returned values (``acc``), so it exercises the plugin's loglikelihood path end to end.
"""

from __future__ import annotations

from PIL import Image

from vtprune.shapes.task import COLORS, COUNT_ANSWERS, QUADRANTS, SHAPES, YES_NO

CHOICES: dict[str, tuple[str, ...]] = {"color": COLORS, "shape": SHAPES, "count": COUNT_ANSWERS, "exists": YES_NO,
                                       "where": QUADRANTS}


def doc_to_visual(doc: dict) -> list[Image.Image]:
    """The document's image, as a one-element list."""
    with Image.open(doc["image"]) as image:
        return [image.convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """``pre_prompt + question + post_prompt`` (both empty by default: the embedded models' format)."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"


def doc_to_choice(doc: dict) -> list[str]:
    """Every answer of the document's question type."""
    return list(CHOICES[doc["qtype"]])


def doc_to_target(doc: dict) -> int:
    """Index of the document's answer among :func:`doc_to_choice`."""
    return doc_to_choice(doc).index(doc["answer"])
