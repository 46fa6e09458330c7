"""Shared inputs of the engine tests: a ragged batch of two samples per model family."""

from __future__ import annotations

import torch

from vtprune.models.tiny import random_image


def two_samples(model_type: str) -> list:
    """Two (question, images) samples of different lengths: Qwen-VL one image each (different sizes), LLaVA
    families one image and two images."""
    if model_type.startswith("qwen"):
        return [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    return [("what color is the circle?", [random_image(120, 90, 1)]),
            ("how many squares are there?", [random_image(64, 80, 2), random_image(90, 60, 3)])]


def lm_input_embeds(model, inputs: dict) -> torch.Tensor:
    """``inputs_embeds`` ``[B, L, D]`` that ``model``'s language model receives for ``inputs`` (a plain forward
    pre-hook on the unwrapped model; no vtprune code)."""
    grabbed = {}

    def grab(module, args, kwargs):
        grabbed["embeds"] = kwargs["inputs_embeds"]

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    return grabbed["embeds"]
