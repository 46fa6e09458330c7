"""Document functions the local lmms-eval tasks share (``tasks/*/utils.py`` re-export them for their YAML)."""

from __future__ import annotations

from PIL import Image


def doc_to_visual(doc: dict) -> list[Image.Image]:
    """The document's image (``doc["image"]``, a PNG path) as a one-element list; a clip's frames
    (``doc["frames"]``) in time order."""
    paths = doc["frames"] if "frames" in doc else [doc["image"]]
    visuals = []
    for path in paths:
        with Image.open(path) as image:
            visuals.append(image.convert("RGB"))
    return visuals


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """``pre_prompt + question + post_prompt`` (both empty by default: the embedded models' format)."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question']}{kwargs.get('post_prompt', '')}"
