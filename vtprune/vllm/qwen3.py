"""Pruned Qwen3-VL in vLLM (images and video): a dropped token leaves together with its DeepStack rows.

vLLM's Qwen3-VL returns each item's rows as ``[n, D * (1 + L)]``: the LLM-input embedding, then the ``L``
DeepStack features the language model adds to that token after its first ``L`` layers. The plugin ranks the
first ``D`` columns (the embedding vtprune's transformers path ranks at its pre-LLM stage) and keeps whole rows,
so every kept token keeps its DeepStack features and a dropped one never enters the LM, which is what
vtprune's transformers path does at layer 0 (``Adapter.prune_lm_inputs``). Kept tokens keep their original
M-RoPE positions (:mod:`vtprune.vllm.qwen`).

Video: Qwen3-VL writes every frame (temporal patch) as ``<t seconds><|vision_start|>`` + its tokens +
``<|vision_end|>``, numbered as a one-frame image after its timestamp. Each frame keeps its own share
(``keep_count(keep, h * w)``, known before the tower runs): the placeholder keeps the timestamps and cuts each
frame's run (:func:`~vtprune.vllm.select.truncate_runs`), and the kept rows fill the runs in order with their
``(0, y, x)`` offsets. That is vtprune's transformers path with ``rounding="per_image"``. ``temporal`` (one
budget over the whole video) would change the frames' runs after the tower ran, so it is refused here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.model_executor.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptUpdateDetails

from vtprune.vllm.common import PPM, keep_field
from vtprune.vllm.positions import media_runs, prompt_positions
from vtprune.vllm.qwen import QwenProcessorMixin, QwenPruningMixin
from vtprune.vllm.select import frame_offsets, grid_extent, grid_offsets, truncate_runs


class VtpruneQwen3VLProcessor(QwenProcessorMixin, Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor with ``kept_count`` placeholders per image and each video frame's share."""

    frame_videos = False  # temporal's whole-video budget does not fit per-frame placeholder runs
    tower_methods = ("visionzip", "vflowopt", "vispruner", "hiprune", "scope")

    def _pruned_update(self, update: Any, out_mm_kwargs: Any) -> Any:
        if update.modality != "video":
            return super()._pruned_update(update, out_mm_kwargs)
        inner, video_token = update.replacement, self.info.get_hf_config().video_token_id

        def replacement(item_idx: int) -> PromptUpdateDetails:
            details = inner(item_idx)
            keep = int(out_mm_kwargs["video"][item_idx][keep_field("video")].data) / PPM
            return PromptUpdateDetails.select_token_id(truncate_runs(details.full, video_token, keep), video_token)

        return dataclasses.replace(update, replacement=replacement)


@MULTIMODAL_REGISTRY.register_processor(VtpruneQwen3VLProcessor, info=Qwen3VLProcessingInfo,
                                        dummy_inputs=Qwen3VLDummyInputsBuilder)
class VtpruneQwen3VLForConditionalGeneration(QwenPruningMixin, Qwen3VLForConditionalGeneration):
    """Qwen3-VL whose image and video embeddings (with their DeepStack rows) are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config, needs_runner=True)

    def selection_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The LLM-input embedding ``[n, D]`` of an item's rows ``[n, D * (1 + L)]`` (what the selection ranks)."""
        return rows[:, :self.visual_dim]

    def item_offsets(self, modality: str, grid: tuple[int, int, int], factor: float) -> torch.Tensor:
        return frame_offsets(grid) if modality == "video" else grid_offsets(grid, factor)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """Text as the unpruned prompt numbers it; an image, or each frame of a video, spans its original extent."""
        if self.vtprune.layer_wise:
            return super().get_mrope_input_positions(input_tokens, mm_features)
        merge = self.config.vision_config.spatial_merge_size
        video_token = self.config.video_token_id
        items = []
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            key = "video_grid_thw" if feature.modality == "video" else "image_grid_thw"
            t, h, w = (int(v) for v in feature.data[key].data.tolist())
            offset, length = feature.mm_position.offset, feature.mm_position.length
            if feature.modality != "video":
                items.append((offset, length, grid_extent((t, h // merge, w // merge))))
                continue
            extent = grid_extent((1, h // merge, w // merge))
            span = torch.as_tensor(input_tokens[offset:offset + length]) == video_token
            items.extend((offset + start, end - start, extent) for start, end in media_runs(span))
        return prompt_positions(len(input_tokens), items)
