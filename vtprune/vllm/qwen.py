"""Pruned Qwen2-VL and Qwen2.5-VL in vLLM: kept tokens keep their original M-RoPE (t, h, w) positions.

Front end: ``kept_count`` placeholders per image / video (a video keeps its share per temporal patch).
Workers: :meth:`embed_multimodal` returns each item's kept rows with their (t, h, w) offsets appended as six
extra columns (high and low parts, exact in bf16); :meth:`get_mrope_input_positions` numbers the text as the
unpruned prompt does; :meth:`recompute_mrope_positions` (vLLM's ``SupportsMultiModalPruning`` hook, which the
runner calls once we switch it on) strips the columns and writes the positions of the chunk's kept rows.
``visionzip`` / ``vflowopt`` / ``vispruner`` / ``hiprune`` / ``scope``: a pre-hook on the last full-attention ViT
block's attention (HiPrune: also its object block's) holds its input during the tower calls; :func:`qwen_block_maps` /
:func:`qwen_block_relevance` recompute that block's attention from its fused ``qkv`` and rotary embedding, and every
image (every temporal patch of a video) keeps :func:`vtprune.vllm.select.visionzip_rows` of its rows (VFlowOpt:
:func:`~vtprune.vllm.select.top_rows`; VisPruner: :func:`~vtprune.vllm.select.vispruner_rows` with the LLM-input
embeddings; SCOPE: :func:`~vtprune.vllm.select.scope_rows`, the same maps; HiPrune:
:func:`~vtprune.vllm.select.hiprune_rows` on the merged grid).
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

from vtprune.vllm.common import PrunedModelMixin, PrunedProcessorMixin, item_keeps, keep_field, modality_order
from vtprune.vllm.positions import fill_chunk, prompt_positions
from vtprune.vllm.select import (
    frame_sizes,
    grid_extent,
    grid_offsets,
    hiprune_rows,
    scope_rows,
    top_rows,
    visionzip_rows,
    vispruner_rows,
)
from vtprune.vllm.settings import TOWER_METHODS

SPLIT = 128  # offsets travel as (v // SPLIT, v % SPLIT): both parts are exact in bf16 below 32,768 * SPLIT
EXTRA = 6


def encode_offsets(offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[k, 3]`` long offsets -> ``[k, 6]`` columns of ``dtype``."""
    return torch.cat([offsets // SPLIT, offsets % SPLIT], dim=1).to(dtype)


def decode_offsets(columns: torch.Tensor) -> torch.Tensor:
    """``[k, 6]`` columns -> ``[k, 3]`` long offsets."""
    values = columns.float().round().long()
    return values[:, :3] * SPLIT + values[:, 3:]


def _block_qk(attention: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Queries and keys ``[S, H, d]`` of vLLM's Qwen-VL ViT attention (``Qwen2VisionAttention``, or Qwen3-VL's
    ``Qwen2_5_VisionAttention``) for its input ``x`` ``[S, 1, D]`` (the block's normed input), after the rotary
    embedding (this rank's heads), and the attention scale."""
    qkv, _ = attention.qkv(x)
    if hasattr(attention, "split_qkv"):
        query, key, _ = (part.transpose(0, 1) for part in attention.split_qkv(qkv))  # [1, S, H, d]
    else:  # [S, 1, (3, H, d)] -> [1, S, H, d] each
        heads, size = attention.num_attention_heads_per_partition, attention.hidden_size_per_attention_head
        query, key, _ = qkv.reshape(qkv.shape[0], qkv.shape[1], 3, heads, size).transpose(0, 1).unbind(dim=2)
    query, key = (part[0] for part in torch.chunk(attention.apply_rotary_emb(torch.cat([query, key]), cos, sin), 2))
    return query, key, float(attention.hidden_size_per_attention_head) ** -0.5


def _segments(bounds: torch.Tensor) -> list[tuple[int, int]]:
    edges = [int(b) for b in bounds.tolist()]
    return [(start, end) for start, end in zip(edges[:-1], edges[1:], strict=True) if end > start]


def qwen_block_maps(attention: Any, x: torch.Tensor, bounds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention received ``[S / unit]`` (fp32; mean over heads and queries within each ``cu_seqlens`` segment, summed
    over each merger unit) and head-mean keys ``[S / unit, d]`` (mean over the unit) of a vLLM Qwen-VL ViT block's
    attention for its input ``x`` ``[S, 1, D]``, with vtprune's :func:`~vtprune.methods.tower.received_attention` and
    :func:`~vtprune.methods.tower.merge_units` (this rank's heads)."""
    from vtprune.methods.tower import merge_units, received_attention, tower_rows

    with torch.no_grad():
        query, key, scale = _block_qk(attention, x, cos, sin)
        values = torch.zeros(query.shape[0], dtype=torch.float32, device=query.device)
        for start, end in _segments(bounds):
            values[start:end] = received_attention(query[start:end].transpose(0, 1), key[start:end].transpose(0, 1),
                                                   scale, rows=tower_rows("auto", end - start, query.device))
        return merge_units(values, key.float().mean(dim=1), unit, None)


def qwen_block_relevance(attention: Any, x: torch.Tensor, bounds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unit: int) -> tuple[torch.Tensor, None]:
    """VFlowOpt's importance ``[S / unit]`` of a vLLM Qwen-VL ViT block's attention for its input ``x``
    ``[S, 1, D]``: per
    ``cu_seqlens`` segment (an image, a temporal patch) vtprune's
    :func:`~vtprune.methods.qwen_vit.streamed_relevance` at the release's threshold scaled to the segment's
    patches, then the mean over each merger unit (:func:`~vtprune.methods.qwen_vit.pool_groups`), as vtprune's
    transformers path builds it (entropy weight 0, the released configurations)."""
    from vtprune.methods.qwen_vit import pool_groups, streamed_relevance
    from vtprune.methods.vflowopt import RELEASED_THRESHOLD, RELEASED_TOKENS

    with torch.no_grad():
        query, key, scale = _block_qk(attention, x, cos, sin)
        parts = [streamed_relevance(query[start:end].transpose(0, 1).float(), key[start:end].transpose(0, 1).float(),
                                    scale, RELEASED_THRESHOLD * (end - start) / RELEASED_TOKENS)
                 for start, end in _segments(bounds)]
        return pool_groups(torch.cat(parts), unit), None


class QwenProcessorMixin(PrunedProcessorMixin):
    modalities = ("image", "video")
    frame_videos = True

    def item_groups(self, item: Any, modality: str, num_rows: int) -> int:
        return int(item[f"{modality}_grid_thw"].data[0]) if modality == "video" else 1


class VtpruneQwen2VLProcessor(QwenProcessorMixin, Qwen2VLMultiModalProcessor):
    """Qwen2-VL's processor with ``kept_count`` placeholders per item."""

    tower_methods = ("visionzip", "vflowopt", "vispruner", "hiprune", "scope")


class VtpruneQwen2_5_VLProcessor(QwenProcessorMixin, Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor with ``kept_count`` placeholders per item."""

    tower_methods = ("visionzip", "vflowopt", "vispruner", "hiprune", "scope")


class QwenPruningMixin(PrunedModelMixin):
    """Selection with original M-RoPE positions for the Qwen-VL classes."""

    def embed_multimodal(self, **kwargs: object):
        keeps = {m: kwargs.pop(keep_field(m), None) for m in ("image", "video")}
        if self.vtprune.layer_wise:  # every visual token enters the language model, which prunes
            return super().embed_multimodal(**kwargs)
        order = modality_order(kwargs)
        grids = {m: kwargs.get(f"{m}_grid_thw") for m in order}
        seconds = kwargs.get("second_per_grid_ts")
        maps = None  # tower methods: [attention or importance, keys or None, rows consumed so far] over the call
        if self.vtprune.method in TOWER_METHODS:
            embeddings, maps = self._tower_maps(kwargs)
        else:
            embeddings = super().embed_multimodal(**kwargs)
        if embeddings is None or len(embeddings) == 0:
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
                if maps is None:
                    kept = self.vtprune_rows(self.selection_rows(rows), keep, frames=t)
                    values = rows[kept]
                elif self.vtprune.method == "vflowopt":
                    kept = self._vflowopt_item(rows, maps, keep)
                    values = rows[kept]
                elif self.vtprune.method in ("vispruner", "hiprune", "scope"):
                    kept = self._frame_item(rows, maps, keep, t, w // merge)
                    values = rows[kept]
                else:
                    kept, values = self._visionzip_item(rows, maps, keep, t)
                offsets = self.item_offsets(modality, (t, h // merge, w // merge), factor)[kept.cpu()]
                out.append(torch.cat([values, encode_offsets(offsets, rows.dtype).to(rows.device)], dim=1))
        return out

    def item_offsets(self, modality: str, grid: tuple[int, int, int], factor: float) -> torch.Tensor:
        """``[t*h*w, 3]`` (t, h, w) M-RoPE offsets of an item's rows from its base (merged ``grid``; ``factor``:
        a video's temporal scale)."""
        return grid_offsets(grid, factor)

    def selection_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """What the selection ranks of an item's rows ``[n, D]`` (all of them; Qwen3-VL: the embedding part)."""
        return rows

    def _tower_maps(self, kwargs: dict) -> tuple[Any, list]:
        """The stock embeddings, run with a pre-hook on the last ViT block's attention (the blocks of Qwen2.5-VL /
        Qwen3-VL are compile-wrapped, which skips hooks on the block itself), and ``[values [S'], keys [S', d] or
        None, 0]`` over all items of the call (in the order the tower runs them, as the embeddings are); HiPrune:
        a fourth entry, the object block's attention ``[S']``."""
        full = list(getattr(self.visual, "fullatt_block_indexes", None) or [len(self.visual.blocks) - 1])
        blocks = [full[-1]]  # Qwen2.5-VL: the last full-attention block
        if self.vtprune.method == "hiprune":
            blocks.append(self._object_block())
        unit = self.config.vision_config.spatial_merge_size ** 2
        maps = qwen_block_relevance if self.vtprune.method == "vflowopt" else qwen_block_maps
        grabbed: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[] for _ in blocks]

        def hook(parts: list) -> Any:
            def grab(module: Any, args: tuple, hook_kwargs: dict) -> None:
                named = dict(zip(("x", "cu_seqlens", "rotary_pos_emb_cos", "rotary_pos_emb_sin"), args)) | hook_kwargs
                parts.append(maps(module, named["x"], named["cu_seqlens"], named["rotary_pos_emb_cos"],
                                  named["rotary_pos_emb_sin"], unit))
            return grab

        handles = [self.visual.blocks[index].attn.register_forward_pre_hook(hook(parts), with_kwargs=True)
                   for index, parts in zip(blocks, grabbed)]
        try:
            embeddings = super().embed_multimodal(**kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if len(embeddings) and not grabbed[0]:
            raise ValueError(f"vtprune: {self.vtprune.method} reads the vision tower's attention; this request passed "
                             "image or video embeddings (no tower call). Pass pixels, or serve 'divprune'.")
        if hasattr(self.visual, "window_size"):  # Qwen2.5-VL's blocks see the merger units in window order
            orders = [self._token_order(kwargs[f"{m}_grid_thw"]) for m in modality_order(kwargs)]
            grabbed = [[(v[o.to(v.device)], None if k is None else k[o.to(k.device)]) for (v, k), o in zip(parts, orders)]
                       for parts in grabbed]
        values = [torch.cat([v for v, _ in parts]) if parts else torch.zeros(0) for parts in grabbed]
        parts = grabbed[0]
        keys = torch.cat([k for _, k in parts]) if parts and parts[0][1] is not None else None
        return embeddings, [values[0], keys, 0, *values[1:]]

    def _object_block(self) -> int:
        """HiPrune's object block: the release's layer scaled to this tower, on a full-attention block
        (:func:`vtprune.methods.hiprune.scaled_object_layer`, as vtprune's transformers path picks it)."""
        from vtprune.methods.hiprune import QWEN_OBJECT, scaled_object_layer

        depth = len(self.visual.blocks)
        full = list(getattr(self.visual, "fullatt_block_indexes", None) or range(depth))
        return scaled_object_layer(depth, full, QWEN_OBJECT)

    def _token_order(self, grid_thw: Any) -> torch.Tensor:
        """Index ``[M]`` putting a tower call's merger units, in the window order its blocks see, back in token
        order (Qwen2.5-VL; the tower's own window index)."""
        grids = torch.as_tensor(grid_thw).reshape(-1, 3).tolist()
        window_index = self.visual.prepare_encoder_metadata(grids, device=torch.device("cpu"))["window_index"]
        return torch.argsort(window_index.cpu())

    def _vflowopt_item(self, rows: torch.Tensor, maps: list, keep: float) -> torch.Tensor:
        """VFlowOpt's pre-LLM stage on one image's rows ``[n, D]``: its ``keep_count(keep, n)`` most important rows."""
        start = maps[2]
        maps[2] = start + rows.shape[0]
        kept = top_rows(maps[0][start:start + rows.shape[0]], keep).to(rows.device)
        self.vtprune_selections.append(kept.tolist())
        return kept

    def _frame_item(self, rows: torch.Tensor, maps: list, keep: float, frames: int, width: int) -> torch.Tensor:
        """VisPruner, HiPrune or SCOPE on one item's rows ``[n, D]``, each temporal patch on its own (``width``: the
        merged grid's row length): sorted kept rows ``[k]``."""
        start = maps[2]
        maps[2] = start + rows.shape[0]
        ranked = self.selection_rows(rows)  # Qwen3-VL: the LLM-input embedding part
        picks, offset = [], 0
        for size in frame_sizes(rows.shape[0], frames):
            part = slice(start + offset, start + offset + size)
            if self.vtprune.method == "hiprune":
                kept = hiprune_rows(maps[3][part], maps[0][part], keep, width)
            else:
                rank = scope_rows if self.vtprune.method == "scope" else vispruner_rows
                kept = rank(maps[0][part], ranked[offset:offset + size], keep)
            picks.append(kept.to(rows.device) + offset)
            offset += size
        kept = torch.cat(picks)
        self.vtprune_selections.append(kept.tolist())
        return kept

    def _visionzip_item(self, rows: torch.Tensor, maps: list, keep: float, frames: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """VisionZip on one item's rows ``[n, D]``, each temporal patch on its own: kept rows ``[k]``, values ``[k, D]``."""
        values, keys, start = maps[0], maps[1], maps[2]
        maps[2] = start + rows.shape[0]
        ranked = self.selection_rows(rows)  # Qwen3-VL: the embedding merges, a target keeps its own DeepStack rows
        picks, kept_values, offset = [], [], 0
        for size in frame_sizes(rows.shape[0], frames):
            part = slice(start + offset, start + offset + size)
            kept, chosen = visionzip_rows(values[part], keys[part], ranked[offset:offset + size], keep)
            if ranked.shape[1] < rows.shape[1]:
                chosen = torch.cat([chosen, rows[offset:offset + size][kept, ranked.shape[1]:]], dim=1)
            picks.append(kept + offset)
            kept_values.append(chosen)
            offset += size
        kept = torch.cat(picks)
        self.vtprune_selections.append(kept.tolist())
        return kept, torch.cat(kept_values)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        if self.vtprune.layer_wise:
            return super().get_mrope_input_positions(input_tokens, mm_features)
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
