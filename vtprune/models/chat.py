"""A conversation about one image: successive questions, each answered after the previous answers.

``followup="reuse"`` continues every later turn from the first turn's KV cache (only the new text is
prefilled): cheap, but what a query-aware method (fastv, pdrop, transprune) pruned was decided by the first
question. ``followup="reprefill"`` re-runs the whole conversation with the image at every turn: pruning is
decided for the current question, at the cost of a full prefill per turn. ``eval/bench_followup.py``
measures the trade-off (docs/methods.md, "Follow-up turns").
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from PIL import Image

FOLLOWUPS = ("reuse", "reprefill")


def _messages(questions: list[str], answers: list[str]) -> list[dict]:
    messages = []
    for turn, question in enumerate(questions):
        content = ([{"type": "image"}] if turn == 0 else []) + [{"type": "text", "text": question}]
        messages.append({"role": "user", "content": content})
        if turn < len(answers):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[turn]}]})
    return messages


def _cache_keyword(model: Any) -> str:
    """``cache`` (transformers >= 5.24) or ``past_key_values`` (before): how generate() takes a cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache(output: Any) -> Any:
    return getattr(output, "cache", None) or output.past_key_values


@torch.inference_mode()
def chat(model: Any, processor: Any, image: Image.Image, questions: list[str], followup: str = "reuse",
         max_new_tokens: int = 8) -> list[str]:
    """Greedy answers to ``questions`` about ``image``, one turn after another (batch 1, chat template).

    With ``reuse``, a turn continues from the previous turn's cache when the conversation re-tokenizes to the
    cached tokens followed by the new ones (the usual case); otherwise that turn is re-prefilled, with a warning.
    """
    if followup not in FOLLOWUPS:
        raise ValueError(f"followup={followup!r} must be one of {', '.join(FOLLOWUPS)}.")
    device = next(model.parameters()).device
    answers: list[str] = []
    previous = None  # (sequences, cache) of the last turn, for reuse
    for turn in range(len(questions)):
        text = processor.apply_chat_template(_messages(questions[:turn + 1], answers), add_generation_prompt=True)
        inputs = {k: v.to(device) for k, v in processor(text=[text], images=[image], return_tensors="pt").items()}
        ids = inputs["input_ids"]
        if previous is not None and followup == "reuse":
            sequences, cache = previous
            if ids.shape[1] > sequences.shape[1] and torch.equal(ids[:, :sequences.shape[1]], sequences):
                extra = {k: v for k, v in inputs.items() if k in ("mm_token_type_ids",)}
                extra[_cache_keyword(model)] = cache
                output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        return_dict_in_generate=True, **extra)
                answers.append(_answer(processor, output, ids))
                previous = (output.sequences, _cache(output))
                continue
            warnings.warn("the conversation re-tokenizes differently from the cached turn; this turn is "
                          "re-prefilled instead of reusing the cache.", stacklevel=2)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        answers.append(_answer(processor, output, ids))
        previous = (output.sequences, _cache(output))
    return answers


def _answer(processor: Any, output: Any, ids: torch.Tensor) -> str:
    return processor.tokenizer.batch_decode(output.sequences[:, ids.shape[1]:], skip_special_tokens=True)[0].strip()
