"""Answer a question about an image with a (possibly wrapped) model and measure what pruning did."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from PIL import Image


@dataclass
class Answer:
    """One answered question with its pruning statistics and timings (milliseconds)."""

    answer: str
    visual_tokens: int
    kept_tokens: list[int]
    stage_layers: list[int]
    kept_indices: list[list[int]]
    prefill_ms: float
    generate_ms: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_inputs(processor: Any, images: list[Image.Image], questions: list[str], model_type: str) -> dict:
    """Processor outputs for one image (list) per question, via the processor's chat template if it has one."""
    from vtprune.models.tiny import prompt_for

    texts = []
    for question in questions:
        if getattr(processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            texts.append(processor.apply_chat_template(messages, add_generation_prompt=True))
        else:
            texts.append(prompt_for(model_type, question))
    if getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer.padding_side = "left"
    return dict(processor(text=texts, images=images, return_tensors="pt", padding=True))


def context_limit(model: Any) -> int | None:
    """``max_position_embeddings`` of the language model (text config), None when the config has none."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if limit else None


def check_prompt_length(model: Any, input_ids: torch.Tensor, max_new_tokens: int = 0, what: str = "the prompt",
                        warn_at: float = 0.9) -> None:
    """Refuse a prompt that, with ``max_new_tokens`` generated, runs past the model's context; warn near it.

    ``input_ids`` is the (padded) ``[B, T]`` batch; the check is on ``T + max_new_tokens`` against the text
    config's ``max_position_embeddings`` (positions beyond it were never trained: answers degrade silently).
    """
    limit = context_limit(model)
    if limit is None:
        return
    length = int(input_ids.shape[-1]) + int(max_new_tokens)
    if length > limit:
        from vtprune.errors import UserError

        raise UserError(
            f"{what} is {int(input_ids.shape[-1])} tokens; with {max_new_tokens} new tokens that is {length}, past "
            f"the model's context of {limit} positions (max_position_embeddings). Shorten the question (or ask "
            "for fewer new tokens / frames)."
        )
    if length > warn_at * limit:
        import warnings

        warnings.warn(f"{what} uses {length} of the model's {limit} positions (with the new tokens); "
                      "longer inputs will be refused.", stacklevel=2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill_ms(model: Any, inputs: dict, repeats: int = 3) -> float:
    """Median wall time of the prompt forward (vision tower + LM prefill, last-token logits), after a warm-up."""
    device = next(model.parameters()).device
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        model(**inputs, logits_to_keep=1)
        _sync(device)
        times.append((time.perf_counter() - start) * 1000.0)
    return float(sorted(times[1:])[len(times[1:]) // 2])


@torch.inference_mode()
def answer_questions(model: Any, processor: Any, images: list[Image.Image], questions: list[str],
                     handle: Any = None, max_new_tokens: int = 8, timing_repeats: int = 1) -> list[Answer]:
    """Greedy answers for a batch of (image, question) pairs; stats come from ``handle`` when wrapped."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
              for k, v in build_inputs(processor, images, questions, model.config.model_type).items()}
    check_prompt_length(model, inputs["input_ids"], max_new_tokens)
    prefill = prefill_ms(model, inputs, timing_repeats) if timing_repeats else float("nan")
    _sync(device)
    start = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    _sync(device)
    generate_ms = (time.perf_counter() - start) * 1000.0
    stats = handle.last_stats if handle is not None else None
    texts = processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    visual = _visual_counts(model, inputs["input_ids"])
    answers = []
    for row, text in enumerate(texts):
        kept = [stage[row] for stage in stats.kept] if stats else []
        indices = [stage[row] for stage in stats.kept_indices] if stats else []
        answers.append(Answer(answer=text.strip(), visual_tokens=visual[row], kept_tokens=kept,
                              stage_layers=list(stats.stage_layers) if stats else [], kept_indices=indices,
                              prefill_ms=prefill, generate_ms=generate_ms))
    return answers


def _visual_counts(model: Any, input_ids: torch.Tensor) -> list[int]:
    from vtprune.adapters import get_adapter

    return get_adapter(model).visual_mask(input_ids).sum(dim=1).tolist()
