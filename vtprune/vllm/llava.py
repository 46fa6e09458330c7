"""``VtpruneLlavaForConditionalGeneration``: vLLM's LLaVA-1.5 with vtprune's pre-LLM selection.

The prompt holds ``kept_count`` image placeholders per image; :meth:`embed_multimodal` returns the kept rows
(sorted). vLLM numbers them consecutively, so positions are compact (vtprune's ``positions="compact"``).
``visionzip``: a pre-hook on vLLM's CLIP encoder layer that vtprune scores (the projector's feature layer) holds
its input during the tower call; :func:`clip_layer_maps` recomputes that layer's attention from its fused
``qkv_proj`` with vtprune's :func:`vtprune.methods.vit.vit_attention` (CLS row, CLS column dropped as the
projector drops it), and :func:`vtprune.vllm.select.visionzip_rows` keeps the dominant rows and merges the rest.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm.model_executor.models.llava import (
    LlavaDummyInputsBuilder,
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from vtprune.vllm.common import PrunedModelMixin, PrunedProcessorMixin, item_keeps, keep_field
from vtprune.vllm.select import visionzip_rows


def clip_layer_maps(layer: Any, hidden: torch.Tensor, cls: bool = True, drop_cls: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention received ``[n, T']`` (fp32, head mean; from the CLS query, or the mean over queries) and head-mean
    keys ``[n, T', d]`` of vLLM's ``CLIPEncoderLayer`` for its input ``hidden`` ``[n, T, D]`` (``T' = T - 1``
    with ``drop_cls``). The fused ``qkv_proj`` is split into the ``q_proj`` / ``k_proj`` vtprune's
    :func:`~vtprune.methods.vit.vit_attention` reads (this rank's heads)."""
    from vtprune.methods.vit import vit_attention

    attention = layer.self_attn
    heads = int(attention.num_heads_per_partition)

    def part(index: int):
        return lambda x: attention.qkv_proj(x)[0].chunk(3, dim=-1)[index]

    shim = SimpleNamespace(layer_norm1=layer.layer_norm1, self_attn=SimpleNamespace(
        num_heads=heads, scale=float(attention.scale), q_proj=part(0), k_proj=part(1)))
    with torch.no_grad():
        maps = vit_attention(shim, hidden)
        values = maps[:, 0, :] if cls else maps.mean(dim=1)
        keys = part(1)(layer.layer_norm1(hidden))
        keys = keys.view(*keys.shape[:2], heads, -1).float().mean(dim=2)
    if drop_cls:
        values, keys = values[:, 1:], keys[:, 1:]
    return values, keys


class VtpruneLlavaProcessingInfo(LlavaProcessingInfo):
    """Budgets (encoder cache, profiling) for an unpruned image: a request may ask for ``vtprune_keep`` 1.0."""

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts):
        return {"image": self.get_max_image_tokens()}


class VtpruneLlavaProcessor(PrunedProcessorMixin, LlavaMultiModalProcessor):
    """LLaVA's processor with ``kept_count`` placeholders per image."""

    item_fields = {"image": "pixel_values"}
    tower_methods = ("visionzip",)


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaProcessor, info=VtpruneLlavaProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VtpruneLlavaForConditionalGeneration(PrunedModelMixin, LlavaForConditionalGeneration):
    """LLaVA-1.5 whose image embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)
        if self.vtprune.method == "visionzip" and vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError("vtprune: visionzip in vLLM reads the tower's attention from one rank's heads; serve it "
                             "with tensor_parallel_size=1 (or serve 'divprune' with tensor parallelism).")

    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(keep_field("image"), None)
        if self.vtprune.method == "visionzip":
            return self._visionzip(keeps, kwargs)
        embeddings = super().embed_multimodal(**kwargs)
        if len(embeddings) == 0:
            return embeddings
        out = []
        for rows, keep in zip(embeddings, item_keeps(keeps, len(embeddings), self.vtprune.keep)):
            out.append(rows[self.vtprune_rows(rows, keep)])
        return out

    def _visionzip(self, keeps: Any, kwargs: dict) -> list[torch.Tensor]:
        """Each image's kept rows ``[k, D]``: tower maps captured during the tower call, then :func:`visionzip_rows`."""
        from vtprune.methods.vit import feature_layer_index

        config = self.config
        layers = self.vision_tower.vision_model.encoder.layers
        layer = layers[feature_layer_index(SimpleNamespace(config=config))]
        inputs: list[torch.Tensor] = []
        handle = layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))
        try:
            embeddings = super().embed_multimodal(**kwargs)
        finally:
            handle.remove()
        if len(embeddings) == 0:
            return embeddings
        if not inputs:
            raise ValueError("vtprune: visionzip reads the vision tower's attention; this request passed image "
                             "embeddings (no tower call). Pass pixels, or serve 'divprune'.")
        drop_cls = config.vision_feature_select_strategy == "default"
        values, keys = (torch.cat(parts) for parts in zip(*(clip_layer_maps(layer, h, drop_cls=drop_cls)
                                                             for h in inputs)))
        out = []
        for index, (rows, keep) in enumerate(zip(embeddings, item_keeps(keeps, len(embeddings), self.vtprune.keep))):
            kept, kept_values = visionzip_rows(values[index], keys[index], rows, keep)
            self.vtprune_selections.append(kept.tolist())
            out.append(kept_values)
        return out
