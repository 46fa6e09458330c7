"""Document functions of the ``vtprune_shapes_mc`` lmms-eval task: ``multiple_choice`` over loglikelihoods.

Documents are the ``vtprune_shapes`` questions whose answer comes from a closed set (colour, shape, count,
yes/no, quadrant; ``read`` questions are left out), written by ``vtprune bench lmms-prepare``.
lmms-eval sends one ``loglikelihood`` request per choice (``" " + choice`` after the question) and scores the
argmin of the returned values (``acc``), so it exercises the plugin's loglikelihood path end to end.
"""

from __future__ import annotations

from vtprune.eval.lmms_plugin.documents import doc_to_text, doc_to_visual  # noqa: F401 (the YAML's)

from vtprune.shapes.task import COLORS, COUNT_ANSWERS, QUADRANTS, SHAPES, YES_NO

CHOICES: dict[str, tuple[str, ...]] = {"color": COLORS, "shape": SHAPES, "count": COUNT_ANSWERS, "exists": YES_NO,
                                       "where": QUADRANTS}


def doc_to_choice(doc: dict) -> list[str]:
    """Every answer of the document's question type."""
    return list(CHOICES[doc["qtype"]])


def doc_to_target(doc: dict) -> int:
    """Index of the document's answer among :func:`doc_to_choice`."""
    return doc_to_choice(doc).index(doc["answer"])
