"""The notes that come with an answer, shared by ``vtprune run`` and the demo: words or a question form the
model cannot read, a centre-cropped image, an empty answer. Each is one sentence naming what to do instead."""

from __future__ import annotations

from typing import Any

from vtprune.media.images import crop_note
from vtprune.models.vocabulary import question_note


def input_notes(processor: Any, question: str, embedded: bool, image_size: tuple[int, int] | None = None) -> list[str]:
    """Notes known before the model runs: the question's vocabulary / form, the processor's centre crop."""
    notes = [question_note(processor, question, embedded)]
    if image_size is not None:
        notes.append(crop_note(processor, image_size))
    return [note for note in notes if note]


def empty_answer_note(answer: str, max_new_tokens: int, who: str = "the model") -> str | None:
    """A note when ``answer`` is empty (nothing but special tokens or whitespace was generated)."""
    if answer.strip():
        return None
    return f"{who} generated no text within {max_new_tokens} new tokens."
