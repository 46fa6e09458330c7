"""Pruned LLaVA-NeXT and LLaVA-OneVision in vLLM: the base view and the tile grid budgeted as vtprune does.

vLLM packs an image as the base view (``side x side`` rows) followed by the unpadded tile grid with one
image-newline row per grid row, exactly as transformers does. vtprune's adapter reports these as two segments
and its per-image methods keep each one's own share (``keep_count(keep, n_base) + keep_count(keep, n_tiles)``,
the transformers path's count under ``rounding="per_image"``); :func:`image_groups` gives the plugin the same
two groups, so the front end reserves that many placeholders before the tower runs and the kept rows equal the
transformers path's. Newline rows are visual tokens like any other, as in the transformers path. A OneVision
video (frames pooled, one newline after the last) is one group, as vtprune's OneVision adapter segments it.
Positions are compact (vLLM numbers the kept rows consecutively), as on LLaVA-1.5.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.llava import LlavaDummyInputsBuilder
from vllm.model_executor.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
)
from vllm.model_executor.models.llava_onevision import (
    LlavaOnevisionDummyInputsBuilder,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionMultiModalProcessor,
    LlavaOnevisionProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vtprune.vllm.common import PrunedModelMixin, PrunedProcessorMixin, keep_field
from vtprune.vllm.select import image_groups


class TileBudgetInfo:
    """Encoder-cache budgets for an unpruned item (a request may ask for ``vtprune_keep`` 1.0): the largest count
    over every grid pinpoint and vLLM's own largest size (OneVision's is tuned to the released checkpoints)."""

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts):
        sizes = [(int(w), int(h)) for h, w in self.get_hf_config().image_grid_pinpoints]
        sizes.append(tuple(self.get_image_size_with_most_features()))
        budgets = {"image": max(self.get_num_image_tokens(image_width=w, image_height=h) for w, h in sizes)}
        if hasattr(self, "get_max_video_tokens"):
            budgets["video"] = self.get_max_video_tokens(seq_len, mm_counts)
        return budgets


class VtpruneLlavaNextProcessingInfo(TileBudgetInfo, LlavaNextProcessingInfo):
    pass


class VtpruneLlavaOnevisionProcessingInfo(TileBudgetInfo, LlavaOnevisionProcessingInfo):
    pass


class TileProcessorMixin(PrunedProcessorMixin):
    """An image keeps its base view's and its tile grid's shares; a video is one group."""

    def item_groups(self, item: Any, modality: str, num_rows: int) -> int | list[int]:
        return image_groups(self.info.get_hf_config(), num_rows) if modality == "image" else 1


class VtpruneLlavaNextProcessor(TileProcessorMixin, LlavaNextMultiModalProcessor):
    modalities = ("image",)


class VtpruneLlavaOnevisionProcessor(TileProcessorMixin, LlavaOnevisionMultiModalProcessor):
    modalities = ("image", "video")


class TileModelMixin(PrunedModelMixin):
    """Each item's kept rows: an image's base view and tile grid keep their own shares, a video is one group."""

    def embed_multimodal(self, **kwargs: object):
        keeps = {m: kwargs.pop(keep_field(m), None) for m in ("image", "video")}
        embeddings = super().embed_multimodal(**kwargs)
        if embeddings is None or len(embeddings) == 0:
            return embeddings
        return self.prune_items(embeddings, kwargs, keeps)

    def row_groups(self, modality: str, num_rows: int) -> int | list[int]:
        return image_groups(self.config, num_rows) if modality == "image" else 1


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaNextProcessor, info=VtpruneLlavaNextProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VtpruneLlavaNextForConditionalGeneration(TileModelMixin, LlavaNextForConditionalGeneration):
    """LLaVA-NeXT whose image embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaOnevisionProcessor, info=VtpruneLlavaOnevisionProcessingInfo,
                                        dummy_inputs=LlavaOnevisionDummyInputsBuilder)
class VtpruneLlavaOnevisionForConditionalGeneration(TileModelMixin, LlavaOnevisionForConditionalGeneration):
    """LLaVA-OneVision whose image and video embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)
