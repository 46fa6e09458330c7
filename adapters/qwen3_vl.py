"""Qwen3-VL (``model_type="qwen3_vl"``): DeepStack visual features injected after the first LM layers."""

from __future__ import annotations

import torch
from vtprune.adapters.qwen2_vl import Qwen2VLAdapter

from vtprune.layout import gather_tokens


class Qwen3VLAdapter(Qwen2VLAdapter):
    """``Qwen3VLForConditionalGeneration``.

    DeepStack adds vision features to the visual positions after LM layers ``0 .. n-1``
    (``n = len(vision_config.deepstack_visual_indexes)``), through a position mask and one feature row per
    visual token, both handed to the language model. The pre-LLM stage (layer 0) prunes a token together with
    its DeepStack rows (:meth:`prune_lm_inputs`), so a dropped token never enters the LM, as in the vLLM
    plugin; a stage inside the LM runs no earlier than layer ``n``, where every DeepStack feature was added.
    """

    model_types = ("qwen3_vl",)
    processor_class = "Qwen3VLProcessor"

    def min_prune_layer(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", []) or [])

    def prune_lm_inputs(self, kwargs: dict, index: torch.Tensor, valid: torch.Tensor) -> dict:
        """Keep the DeepStack mask ``[B, L']`` and feature rows ``[V', D]`` of the kept visual slots."""
        mask, features = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if mask is None or features is None:
            return kwargs
        mask = mask.to(index.device)
        rank = (mask.flatten().long().cumsum(0) - 1).view(mask.shape)  # row of each visual slot, row-major
        kept = gather_tokens(mask, index, 1) & valid
        rows = gather_tokens(rank, index, 1)[kept]
        return {**kwargs, "visual_pos_masks": kept,
                "deepstack_visual_embeds": [part[rows.to(part.device)] for part in features]}
