"""``VtpruneLlavaForConditionalGeneration``: vLLM's LLaVA-1.5 with vtprune's pre-LLM selection.

The prompt holds ``kept_count`` image placeholders per image; :meth:`embed_multimodal` returns the kept rows
(sorted). vLLM numbers them consecutively, so positions are compact (vtprune's ``positions="compact"``).
"""

from __future__ import annotations

from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vtprune.vllm.common import PrunedModelMixin, PrunedProcessorMixin, item_keeps, keep_field


class VtpruneLlavaProcessingInfo(LlavaProcessingInfo):
    """Budgets (encoder cache, profiling) for an unpruned image: a request may ask for ``vtprune_keep`` 1.0."""

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts):
        return {"image": self.get_max_image_tokens()}


class VtpruneLlavaProcessor(PrunedProcessorMixin, LlavaMultiModalProcessor):
    """LLaVA's processor with ``kept_count`` placeholders per image."""

    item_fields = {"image": "pixel_values"}


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaProcessor, info=VtpruneLlavaProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VtpruneLlavaForConditionalGeneration(PrunedModelMixin, LlavaForConditionalGeneration):
    """LLaVA-1.5 whose image embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)

    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(keep_field("image"), None)
        embeddings = super().embed_multimodal(**kwargs)
        if len(embeddings) == 0:
            return embeddings
        out = []
        for rows, keep in zip(embeddings, item_keeps(keeps, len(embeddings), self.vtprune.keep)):
            out.append(rows[self.vtprune_rows(rows, keep)])
        return out
