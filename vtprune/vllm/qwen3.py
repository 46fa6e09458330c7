"""Pruned Qwen3-VL in vLLM (images): a dropped token leaves together with its DeepStack rows.

vLLM's Qwen3-VL returns each image's rows as ``[n, D * (1 + L)]``: the LLM-input embedding, then the ``L``
DeepStack features the language model adds to that token after its first ``L`` layers. The plugin ranks the
first ``D`` columns (the embedding vtprune's transformers path ranks at its pre-LLM stage) and keeps whole rows,
so every kept token keeps its DeepStack features and a dropped one never enters the LM, which is what
vtprune's transformers path does at layer 0 (``Adapter.prune_lm_inputs``). Kept tokens keep their original
M-RoPE positions (:mod:`vtprune.vllm.qwen`).

Video is refused at start-up: Qwen3-VL writes a timestamp (text) before every frame inside the video's
placeholder, which the plugin does not re-number yet; serve with ``limit_mm_per_prompt={"video": 0}``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vtprune.vllm.positions import prompt_positions
from vtprune.vllm.qwen import QwenProcessorMixin, QwenPruningMixin
from vtprune.vllm.select import grid_extent

VIDEO_MESSAGE = ("vtprune: Qwen3-VL video is not pruned by the vLLM plugin yet (a timestamp is written before every "
                 "frame inside the video placeholder); start vLLM with limit_mm_per_prompt={'video': 0} "
                 "(vtprune serve does), or serve video with Qwen2-VL / Qwen2.5-VL.")


class VtpruneQwen3VLProcessor(QwenProcessorMixin, Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor with ``kept_count`` placeholders per image; video refused at start-up."""

    frame_videos = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.info.ctx.get_mm_config().get_limit_per_prompt("video") > 0:
            raise ValueError(VIDEO_MESSAGE)


@MULTIMODAL_REGISTRY.register_processor(VtpruneQwen3VLProcessor, info=Qwen3VLProcessingInfo,
                                        dummy_inputs=Qwen3VLDummyInputsBuilder)
class VtpruneQwen3VLForConditionalGeneration(QwenPruningMixin, Qwen3VLForConditionalGeneration):
    """Qwen3-VL whose image embeddings (with their DeepStack rows) are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config, needs_runner=True)

    def selection_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The LLM-input embedding ``[n, D]`` of an item's rows ``[n, D * (1 + L)]`` (what the selection ranks)."""
        return rows[:, :self.visual_dim]

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        merge = self.config.vision_config.spatial_merge_size
        items = []
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality != "image":
                raise ValueError(VIDEO_MESSAGE)
            t, h, w = (int(v) for v in feature.data["image_grid_thw"].data.tolist())
            items.append((feature.mm_position.offset, feature.mm_position.length,
                          grid_extent((t, h // merge, w // merge))))
        return prompt_positions(len(input_tokens), items)
