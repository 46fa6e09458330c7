"""Qwen2.5-VL (``model_type="qwen2_5_vl"``): windowed-attention ViT; the LLM side is as Qwen2-VL."""

from __future__ import annotations

import sys

import torch
from vtprune.adapters.qwen2_vl import Qwen2VLAdapter


class Qwen25VLAdapter(Qwen2VLAdapter):
    """``Qwen2_5_VLForConditionalGeneration``; the token layout and M-RoPE handling match Qwen2-VL.

    The ViT attends within windows except in ``fullatt_block_indexes``, and its blocks see the merger units
    in window order (``get_vision_window_index``), undone after the merger.
    """

    model_types = ("qwen2_5_vl",)
    processor_class = "Qwen2_5_VLProcessor"

    def vit_full_attention_blocks(self) -> list[int]:
        return sorted(int(i) for i in getattr(self.config.vision_config, "fullatt_block_indexes", []) or [])

    def vit_merged_order(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        tower = self.vision_tower
        window_index = sys.modules[type(tower).__module__].get_vision_window_index(
            grid_thw, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
            patch_size=tower.patch_size)[0]
        return torch.argsort(window_index)
