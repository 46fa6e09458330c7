"""``VtpruneLlavaForConditionalGeneration``: vLLM's LLaVA-1.5 with vtprune's pre-LLM selection.

The prompt holds ``kept_count`` image placeholders per image; :meth:`embed_multimodal` returns the kept rows
(sorted). vLLM numbers them consecutively, so positions are compact (vtprune's ``positions="compact"``).
``visionzip`` (``vflowopt``, ``vispruner``, ``hiprune``, ``scope`` alike): a pre-hook on vLLM's CLIP encoder layer
that vtprune scores (the projector's feature layer) holds its input during the tower call; :func:`clip_layer_maps`
recomputes that layer's attention from its fused ``qkv_proj`` with vtprune's
:func:`vtprune.methods.vit.vit_attention` (CLS row, CLS column dropped as the projector drops it), and
:func:`vtprune.vllm.select.visionzip_rows` keeps the dominant rows and merges the rest.
VisPruner and SCOPE also read that layer's output (the pre-projector features, CLS dropped) for their diverse rounds
and coverage (:func:`vtprune.vllm.select.vispruner_rows`, :func:`~vtprune.vllm.select.scope_rows`); HiPrune also
reads the attention at its object layer, from all queries at both layers (:func:`vtprune.vllm.select.hiprune_rows`).
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
from vtprune.vllm.select import hiprune_rows, scope_rows, top_rows, visionzip_rows, vispruner_rows
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
    tower_methods = ("visionzip", "vflowopt", "vispruner", "hiprune", "scope")


@MULTIMODAL_REGISTRY.register_processor(VtpruneLlavaProcessor, info=VtpruneLlavaProcessingInfo,
                                        dummy_inputs=LlavaDummyInputsBuilder)
class VtpruneLlavaForConditionalGeneration(PrunedModelMixin, LlavaForConditionalGeneration):
    """LLaVA-1.5 whose image embeddings are pruned before the language model."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtprune_init(vllm_config)
        if self.vtprune.method == "hiprune" and self.config.vision_feature_select_strategy == "full":
            raise ValueError("vtprune: hiprune's buffer tokens need the patch grid, but this LLaVA keeps the CLS "
                             "token (vision_feature_select_strategy='full'); serve 'vispruner' or 'visionzip'.")

    def embed_multimodal(self, **kwargs: object):
        keeps = kwargs.pop(keep_field("image"), None)
        if self.vtprune.method in TOWER_METHODS:
            return self._tower_method(keeps, kwargs)
        embeddings = super().embed_multimodal(**kwargs)
        if len(embeddings) == 0:
            return embeddings
        return self.prune_items(embeddings, kwargs, {"image": keeps})

    def _tower_method(self, keeps: Any, kwargs: dict) -> list[torch.Tensor]:
        """Each image's kept rows ``[k, D]`` from the scored tower layer's input (and VisPruner, SCOPE: its output,
        the pre-projector features; HiPrune: the object layer's input too), captured during the tower call:
        :func:`visionzip_rows` (dominant + contextual), :func:`top_rows` of VFlowOpt's importance,
        :func:`vispruner_rows`, :func:`scope_rows` or :func:`hiprune_rows`."""
        from vtprune.methods.vit import feature_layer_index

        config, method = self.config, self.vtprune.method
        layers = self.vision_tower.vision_model.encoder.layers
        layer = layers[feature_layer_index(SimpleNamespace(config=config))]
        inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        objects: list[torch.Tensor] = []
        handles = [layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach()))]
        if method in ("vispruner", "scope"):
            handles.append(layer.register_forward_hook(lambda module, args, out: outputs.append(out.detach())))
        if method == "hiprune":
            handles.append(layers[self._object_layer()].register_forward_pre_hook(
                lambda module, args: objects.append(args[0].detach())))
        try:
            embeddings = super().embed_multimodal(**kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if len(embeddings) == 0:
            return embeddings
        if not inputs:
            raise ValueError(f"vtprune: {method} reads the vision tower's attention; this request passed image "
                             "embeddings (no tower call). Pass pixels, or serve 'divprune'.")
        drop_cls = config.vision_feature_select_strategy == "default"
        select = self._selection(layer, layers, inputs, outputs, objects, drop_cls)
        out = []
        for index, (rows, keep) in enumerate(zip(embeddings, item_keeps(keeps, len(embeddings), self.vtprune.keep))):
            kept, kept_values = select(index, rows, keep)
            self.vtprune_selections.append(kept.tolist())
            out.append(kept_values)
        return out

    def _object_layer(self) -> int:
        """HiPrune's object layer (0-based) of this CLIP tower: the release's scaled to its depth
        (:func:`vtprune.methods.hiprune.scaled_object_layer`, as vtprune's transformers path picks it)."""
        from vtprune.methods.hiprune import scaled_object_layer

        return scaled_object_layer(int(self.config.vision_config.num_hidden_layers))

    def _selection(self, layer: Any, layers: Any, inputs: list, outputs: list, objects: list, drop_cls: bool) -> Any:
        """``(image index, rows [n, D], keep) -> (kept rows [k], their values [k, D])`` of the served method, from
        the captured tower layers' inputs ``[crops, T, D_v]`` (and outputs)."""
        method = self.vtprune.method
        if method == "vflowopt":
            relevance = torch.cat([clip_layer_relevance(layer, h, drop_cls) for h in inputs])
            return lambda index, rows, keep: _rows_values(top_rows(relevance[index], keep), rows)
        if method == "hiprune":
            deep = torch.cat([clip_layer_maps(layer, h, cls=False, drop_cls=drop_cls)[0] for h in inputs])
            shallow = torch.cat([clip_layer_maps(layers[self._object_layer()], h, cls=False, drop_cls=drop_cls)[0]
                                 for h in objects])
            width = int(self.config.vision_config.image_size) // int(self.config.vision_config.patch_size)
            return lambda index, rows, keep: _rows_values(hiprune_rows(shallow[index], deep[index], keep, width), rows)
        values, keys = (torch.cat(parts) for parts in zip(*(clip_layer_maps(layer, h, drop_cls=drop_cls)
                                                             for h in inputs)))
        if method in ("vispruner", "scope"):
            features = torch.cat([h[:, 1:] if drop_cls else h for h in outputs])
            rank = vispruner_rows if method == "vispruner" else scope_rows
            return lambda index, rows, keep: _rows_values(rank(values[index], features[index], keep), rows)
        return lambda index, rows, keep: visionzip_rows(values[index], keys[index], rows, keep)


def _rows_values(kept: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept [k], rows[kept] [k, D])`` with ``kept`` on the rows' device."""
    kept = kept.to(rows.device)
    return kept, rows[kept]
