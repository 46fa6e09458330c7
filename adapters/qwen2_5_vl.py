"""Qwen2.5-VL (``model_type="qwen2_5_vl"``): windowed-attention ViT; the LLM side is as Qwen2-VL."""

from __future__ import annotations

from vtprune.adapters.qwen2_vl import Qwen2VLAdapter


class Qwen25VLAdapter(Qwen2VLAdapter):
    """``Qwen2_5_VLForConditionalGeneration``; the token layout and M-RoPE handling match Qwen2-VL."""

    model_types = ("qwen2_5_vl",)
    processor_class = "Qwen2_5_VLProcessor"
