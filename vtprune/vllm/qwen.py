"""Pruned Qwen2-VL and Qwen2.5-VL in vLLM: kept tokens keep their original M-RoPE (t, h, w) positions.

Front end: ``kept_count`` placeholders per image / video (a video keeps its share per temporal patch).
Workers: :meth:`embed_multimodal` returns each item's kept rows with their (t, h, w) offsets appended as six
extra columns (high and low parts, exact in bf16); :meth:`get_mrope_input_positions` numbers the text as the
unpruned prompt does; :meth:`recompute_mrope_positions` (vLLM's ``SupportsMultiModalPruning`` hook, which the
runner calls once we switch it on) strips the columns and writes the positions of the chunk's kept rows.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.interfaces import SupportsMultiModalPruning
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.model_executor.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vtprune.vllm.common import PrunedModelMixin, PrunedProcessorMixin, item_keeps, keep_field
from vtprune.vllm.positions import fill_chunk, prompt_positions
from vtprune.vllm.select import grid_extent, grid_offsets

SPLIT = 128  # offsets travel as (v // SPLIT, v % SPLIT): both parts are exact in bf16 below 32,768 * SPLIT
EXTRA = 6


def encode_offsets(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[k, 3]`` long offsets -> ``[k, 6]`` columns of ``dtype``."""
    return torch.cat([offsets // SPLIT, offsets % SPLIT], dim=1).to(dtype)


def decode_offsets(columns: torch.Tensor) -> torch.Tensor:
    """``[k, 6]`` columns -> ``[k, 3]`` long offsets."""
    values = columns.float().round().long()
    return values[:, :3] * SPLIT + values[:, 3:]


class QwenProcessorMixin(PrunedProcessorMixin):
    item_fields = {"image": "image_grid_thw", "video": "video_grid_thw"}

    def item_frames(self, item: Any, modality: str) -> int:
        return int(item[f"{modality}_grid_thw"].data[0]) if modality == "video" else 1


class VtpruneQwen2VLProcessor(QwenProcessorMixin, Qwen2VLMultiModalProcessor):
    """Qwen2-VL's processor with ``kept_count`` placeholders per item."""


class VtpruneQwen2_5_VLProcessor(QwenProcessorMixin, Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor with ``kept_count`` placeholders per item."""


class QwenPruningMixin(PrunedModelMixin):
    """Selection with original M-RoPE positions for the Qwen-VL classes."""

    def _item_order(self, kwargs: dict) -> list[str]:
        order: list[str] = []
        for key in kwargs:
            if key in ("pixel_values", "image_embeds") and "image" not in order:
                order.append("image")
            if key in ("pixel_values_videos", "video_embeds") and "video" not in order:
                order.append("video")
        return order

    def embed_multimodal(self, **kwargs: object):
        keeps = {m: kwargs.pop(keep_field(m), None) for m in ("image", "video")}
        order = self._item_order(kwargs)
        grids = {m: kwargs.get(f"{m}_grid_thw") for m in order}
        seconds = kwargs.get("second_per_grid_ts")
        embeddings = super().embed_multimodal(**kwargs)
        if len(embeddings) == 0:
            return embeddings
        self.enable_position_updates()
        merge = self.config.vision_config.spatial_merge_size
        per_second = getattr(self.config.vision_config, "tokens_per_second", 1.0)
        out, index = [], 0
        for modality in order:
            grid = torch.as_tensor(grids[modality]).reshape(-1, 3).tolist()
            item_keep = item_keeps(keeps[modality], len(grid), self.vtprune.keep)
            for number, ((t, h, w), keep) in enumerate(zip(grid, item_keep)):
                rows = embeddings[index]
                index += 1
                factor = 1.0
                if modality == "video" and seconds is not None:
                    factor = float(torch.as_tensor(seconds).reshape(-1)[number]) * per_second
                kept = self.vtprune_rows(rows, keep, frames=t)
                offsets = grid_offsets((t, h // merge, w // merge), factor)[kept.cpu()]
                out.append(torch.cat([rows[kept], encode_offsets(offsets, rows.dtype).to(rows.device)], dim=1))
        return out

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        features = sorted(mm_features, key=lambda f: f.mm_position.offset)
        items = [(offset, feature.mm_position.length, grid_extent((t, h, w), factor))
                 for (offset, t, h, w, factor), feature in zip(self.iter_mm_grid_thw(features), features)]
        return prompt_positions(len(input_tokens), items)

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        rows = [e[:, :-EXTRA] for e in multimodal_embeddings]
        if not multimodal_embeddings:
            return rows, mrope_positions, int(mrope_positions.max()) + 1 - mrope_positions.shape[1]
        ids = torch.as_tensor(input_ids).cpu()
        media = (ids == self.config.image_token_id) | (ids == self.config.video_token_id)
        offsets = [decode_offsets(e[:, -EXTRA:]).cpu() for e in multimodal_embeddings]
        positions = fill_chunk(mrope_positions.cpu(), media, offsets, num_computed_tokens)
        positions = positions.to(mrope_positions.device)
        return rows, positions, int(positions.max()) + 1 - positions.shape[1]


@MULTIMODAL_REGISTRY.register_processor(VtpruneQwen2VLProcessor, info=Qwen2VLProcessingInfo,
                                        dummy_inputs=Qwen2VLDummyInputsBuilder)
class VtpruneQwen2VLForConditionalGeneration(QwenPruningMixin, Qwen2VLForConditionalGeneration,
                                             SupportsMultiModalPruning):
    """Qwen2-VL whose image / video embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config, needs_runner=True)


@MULTIMODAL_REGISTRY.register_processor(VtpruneQwen2_5_VLProcessor, info=Qwen2_5_VLProcessingInfo,
                                        dummy_inputs=Qwen2_5_VLDummyInputsBuilder)
class VtpruneQwen2_5_VLForConditionalGeneration(QwenPruningMixin, Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL whose image / video embeddings are pruned before the language model (its EVS stays off)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config, needs_runner=True)
