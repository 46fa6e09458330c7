"""What a model can read: words its tokenizer does not know, and the embedded models' question forms.

The embedded models have a whole-word tokenizer of the vtprune-shapes vocabulary (81 words for the LLaVA,
87 for the Qwen2-VL); any other word becomes ``<unk>`` and the answer is a guess or empty. They were also
trained on six question templates only. :func:`question_note` says so before the user reads a bad answer.
Real checkpoints (byte-level BPE) never produce ``<unk>``, so they get no note.
"""

from __future__ import annotations

import functools
import re
from typing import Any

WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'-]*|[^\sA-Za-z0-9]")


def unknown_words(processor: Any, text: str) -> list[str]:
    """Words of ``text`` that the processor's tokenizer turns into its unknown token, in order, once each."""
    tokenizer = getattr(processor, "tokenizer", processor)
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    unknown = []
    for word in WORD.findall(text):
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if unk in ids and word not in unknown:
            unknown.append(word)
    return unknown


@functools.cache
def _templates() -> tuple[re.Pattern, ...]:
    """The vtprune-shapes question templates (images and clips) as regular expressions over the vocabulary."""
    from vtprune.shapes.task import COLORS, PLURALS, SHAPES, TEMPLATES, VIDEO_TEMPLATES

    fill = {"shape": "|".join(SHAPES), "color": "|".join(COLORS), "plural": "|".join(PLURALS.values())}
    patterns = []
    for template in (*TEMPLATES.values(), *VIDEO_TEMPLATES.values()):
        pattern = re.escape(template)
        for key, words in fill.items():
            pattern = pattern.replace(re.escape("{" + key + "}"), f"(?:{words})")
        patterns.append(re.compile(pattern + r"(?:\s.*)?"))  # clip questions may carry options after the '?'
    return tuple(patterns)


def example_questions() -> list[str]:
    """One filled-in question per template, e.g. ``What color is the circle?``."""
    from vtprune.shapes.task import TEMPLATES

    return [TEMPLATES[kind].format(shape="circle", color="red", plural="squares") for kind in TEMPLATES]


def question_note(processor: Any, question: str, embedded: bool) -> str | None:
    """A warning when ``question`` is outside what the model can read, else None.

    Any model: words its tokenizer maps to the unknown token. The embedded models (``embedded=True``):
    also a question that follows none of the vtprune-shapes templates.
    """
    unknown = unknown_words(processor, question)
    off_template = embedded and not any(p.fullmatch(question.strip()) for p in _templates())
    if not unknown and not off_template:
        return None
    if not embedded:
        return (f"the model's tokenizer does not know {', '.join(map(repr, unknown))} (they become its unknown "
                "token); the answer cannot use them.")
    size = len(getattr(processor, "tokenizer", processor))
    what = (f"these words are not in its vocabulary: {', '.join(map(repr, unknown))}" if unknown
            else "the question follows none of its templates")
    return (f"the embedded model knows only the vtprune-shapes task ({size}-token vocabulary, six question forms) and "
            f"{what}, so its answer is a guess or empty. Ask e.g. {' / '.join(map(repr, example_questions()[:3]))} "
            "about an image from `vtprune sample --image shapes.png`, or use a real model (--model "
            "llava-hf/llava-1.5-7b-hf).")
