"""Qwen3-VL (``model_type="qwen3_vl"``): DeepStack visual features injected after the first LM layers."""

from __future__ import annotations

from vtprune.adapters.qwen2_vl import Qwen2VLAdapter


class Qwen3VLAdapter(Qwen2VLAdapter):
    """``Qwen3VLForConditionalGeneration``.

    DeepStack adds vision features to the visual positions after LM layers ``0 .. n-1``
    (``n = len(vision_config.deepstack_visual_indexes)``), using a full-length position mask. vtprune
    therefore prunes no earlier than before layer ``n``, where every DeepStack feature has been added.
    """

    model_types = ("qwen3_vl",)
    processor_class = "Qwen3VLProcessor"

    def min_prune_layer(self) -> int:
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", []) or [])
