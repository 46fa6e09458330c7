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
from vtprune.vllm.select import top_rows, visionzip_rows
from vtprune.vllm.settings import TOWER_METHODS


def vllm_clip_shim(layer: Any) -> SimpleNamespace:
    """vLLM's ``CLIPEncoderLayer`` seen as the ``layer_norm1`` / ``self_attn.{q,k}_proj`` module vtprune's
    :func:`~vtprune.methods.vit.vit_attention` reads (the fused ``qkv_proj`` split; this rank's heads)."""
    attention = layer.self_attn

    def part(index: int):
        return lambda x: attention.qkv_proj(x)[0].chunk(3, dim=-1)[index]

    return SimpleNamespace(layer_norm1=layer.layer_norm1, self_attn=SimpleNamespace(
        num_heads=int(attention.num_heads_per_partition), scale=float(attention.scale), q_proj=part(0),
        k_proj=part(1)))


def clip_layer_maps(layer: Any, hidden: torch.Tensor, cls: bool = True, drop_cls: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention received ``[n, T']`` (fp32, head mean; from the CLS query, or the mean over queries) and head-mean
    keys ``[n, T', d]`` of vLLM's ``CLIPEncoderLayer`` for its input ``hidden`` ``[n, T, D]`` (``T' = T - 1``
    with ``drop_cls``), with vtprune's :func:`~vtprune.methods.vit.vit_attention`."""
    from vtprune.methods.vit import vit_attention

    shim = vllm_clip_shim(layer)
    with torch.no_grad():
        maps = vit_attention(shim, hidden)
        values = maps[:, 0, :] if cls else maps.mean(dim=1)
        keys = shim.self_attn.k_proj(layer.layer_norm1(hidden))
        keys = keys.view(*keys.shape[:2], shim.self_attn.num_heads, -1).float().mean(dim=2)
    if drop_cls:
        values, keys = values[:, 1:], keys[:, 1:]
    return values, keys


def clip_layer_relevance(layer: Any, hidden: torch.Tensor, drop_cls: bool = True) -> torch.Tensor:
    """VFlowOpt's importance ``[n, T']`` of vLLM's ``CLIPEncoderLayer`` for its input ``hidden`` ``[n, T, D]``:
    vtprune's :func:`~vtprune.methods.vit.context_relevance` at the release's threshold (35 scaled from 730
    tokens to ``T``), the CLS column dropped as the projector drops it."""
    from vtprune.methods.vflowopt import RELEASED_THRESHOLD, RELEASED_TOKENS
    from vtprune.methods.vit import context_relevance, vit_attention

    with torch.no_grad():
        maps = vit_attention(vllm_clip_shim(layer), hidden)
        relevance = context_relevance(maps, RELEASED_THRESHOLD * maps.shape[-1] / RELEASED_TOKENS)
    return relevance[:, 1:] if drop_cls else relevance


class VtpruneLlavaProcessingInfo(LlavaProcessingInfo):
    """Budgets (encoder cache, profiling) for an unpruned image: a request may ask for ``vtprune_keep`` 1.0."""

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts):
        return {"image": self.get_max_image_tokens()}


class VtpruneLlavaProcessor(PrunedProcessorMixin, LlavaMultiModalProcessor):
    """LLaVA's processor with ``kept_count`` placeholders per image."""

    modalities = ("image",)
    tower_methods = ("visionzip", "vflowopt")


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaProcessor, info=VtpruneLlavaProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VtpruneLlavaForConditionalGeneration(PrunedModelMixin, LlavaForConditionalGeneration):
    """LLaVA-1.5 whose image embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)

    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(keep_field("image"), None)
        if self.vtprune.method in TOWER_METHODS:
            return self._tower_method(keeps, kwargs)
        embeddings = super().embed_multimodal(**kwargs)
        if len(embeddings) == 0:
            return embeddings
        return self.prune_items(embeddings, kwargs, {"image": keeps})

    def _tower_method(self, keeps: Any, kwargs: dict) -> list[torch.Tensor]:
        """Each image's kept rows ``[k, D]`` from the scored tower layer's input, captured during the tower call:
        :func:`visionzip_rows` (dominant + contextual) or :func:`top_rows` of VFlowOpt's importance."""
        from vtprune.methods.vit import feature_layer_index

        config, method = self.config, self.vtprune.method
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
            raise ValueError(f"vtprune: {method} reads the vision tower's attention; this request passed image "
                             "embeddings (no tower call). Pass pixels, or serve 'divprune'.")
        drop_cls = config.vision_feature_select_strategy == "default"
        if method == "vflowopt":
            relevance = torch.cat([clip_layer_relevance(layer, h, drop_cls) for h in inputs])
        else:
            values, keys = (torch.cat(parts) for parts in zip(*(clip_layer_maps(layer, h, drop_cls=drop_cls)
                                                                 for h in inputs)))
        out = []
        for index, (rows, keep) in enumerate(zip(embeddings, item_keeps(keeps, len(embeddings), self.vtprune.keep))):
            if method == "vflowopt":
                kept = top_rows(relevance[index], keep).to(rows.device)
                kept_values = rows[kept]
            else:
                kept, kept_values = visionzip_rows(values[index], keys[index], rows, keep)
            self.vtprune_selections.append(kept.tolist())
            out.append(kept_values)
        return out
