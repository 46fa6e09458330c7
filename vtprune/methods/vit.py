"""Vision-tower side of VFlowOpt (arXiv:2508.05211): ViT attention, context relevance, and token layout.

CLIP and SigLIP towers (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision): their attention has no rotary embedding and
no mask, so one layer's head-averaged softmax is recomputed from its ``layer_norm1``, ``q_proj`` and ``k_proj``
on the captured layer input (no eager attention in the model). Qwen-VL towers (2-D rotary, windowed blocks,
patch merger): :mod:`vtprune.methods.qwen_vit`. Both end in per-image maps that :func:`distribute` lays out
over each sample's visual tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vtprune.adapters.base import VisualSegment
from vtprune.methods.tiles import image_layouts, tile_values


# -- pure functions ----------------------------------------------------------------------------------------
def vit_attention(layer: nn.Module, hidden: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """Head-averaged softmax attention ``[n, T, T]`` (fp32, queries x keys) of a CLIP/SigLIP encoder layer.

    hidden: ``[n, T, D]`` the layer's input. Uses ``layer.layer_norm1`` and ``layer.self_attn.{q,k}_proj``;
    ``chunk`` crops at a time bound the ``[chunk, H, T, T]`` fp32 block.
    """
    attention = layer.self_attn
    heads = int(attention.num_heads)
    maps = []
    for part in hidden.split(chunk):
        normed = layer.layer_norm1(part)
        n, length, _ = normed.shape
        query = attention.q_proj(normed).view(n, length, heads, -1).transpose(1, 2).float()
        key = attention.k_proj(normed).view(n, length, heads, -1).transpose(1, 2).float()
        scale = float(getattr(attention, "scale", query.shape[-1] ** -0.5))
        maps.append(torch.softmax(query @ key.transpose(-1, -2) * scale, dim=-1).mean(dim=1))
    return torch.cat(maps)


def context_relevance(attention: torch.Tensor, threshold: float) -> torch.Tensor:
    """Attention paid to each token by the high-receipt tokens ``[n, T]`` (VFlowOpt Eq. 1-4).

    ``c_j = sum_i A_ij`` (received attention; its mean is 1), ``K = {j : c_j > threshold}`` and
    ``relevance_i = mean_{k in K} A_ki`` (the released code's mean; the paper writes a sum, which only
    rescales against the entropy weight). An empty ``K`` falls back to all queries (mean received attention).
    """
    received = attention.sum(dim=1)
    chosen = (received > threshold).float()
    empty = chosen.sum(dim=1, keepdim=True) == 0
    chosen = torch.where(empty, torch.ones_like(chosen), chosen)
    return (chosen[:, :, None] * attention).sum(dim=1) / chosen.sum(dim=1, keepdim=True)


def _cell_grid(segment: Any, side: float) -> tuple[tuple[float, float], int, int]:
    """The cell span ``(rows, cols)`` of one segment and its number of cell rows and columns per frame.

    A flat segment (grid unknown, ``h == 1``) groups ``a^2`` consecutive tokens."""
    span = (1.0, side * side) if segment.h == 1 else (side, side)
    return span, int((segment.h - 1) // span[0]) + 1, int((segment.w - 1) // span[1]) + 1


def cell_count(segments: list, cell: float | list[float]) -> int:
    """Cells of one sample (an upper bound on :func:`cell_ids` + 1), computed on the host from the segments."""
    sides = list(cell) if isinstance(cell, (list, tuple)) else [cell] * len(segments)
    return sum(segment.t * rows * cols for segment, side in zip(segments, sides, strict=True)
               for _, rows, cols in [_cell_grid(segment, side)])


def cell_ids(segments: list, count: int, cell: float | list[float]) -> torch.Tensor:
    """Recycling cell ``[count]`` of each visual token of one sample (-1: no cell), VFlowOpt Sec. 3.3.

    A token at ``(frame, row, col)`` of a segment's grid lies in cell ``(frame, floor(row/a), floor(col/a))``;
    every segment (base view, tile grid incl. its newline column, frame) has its own cells. A segment's
    ``extra`` tokens come first (LLaVA ``full`` strategy: CLS) and get no cell. A flat segment (grid
    unknown, ``h == 1``) groups ``a^2`` consecutive tokens. ``cell``: one side ``a`` for every segment, or one
    per segment (Qwen-VL images of different sizes).
    """
    out = torch.full((count,), -1, dtype=torch.long)
    offset = 0
    sides = list(cell) if isinstance(cell, (list, tuple)) else [cell] * len(segments)
    for segment, side in zip(segments, sides, strict=True):
        grid = segment.t * segment.h * segment.w
        index = torch.arange(grid)
        frame, rest = index // (segment.h * segment.w), index % (segment.h * segment.w)
        row, col = rest // segment.w, rest % segment.w
        span, rows, cols = _cell_grid(segment, side)
        row, col = (row / span[0]).floor().long(), (col / span[1]).floor().long()
        ids = offset + (frame * rows + row) * cols + col
        begin = segment.start + segment.extra
        end = min(count, begin + grid)
        if end > begin:
            out[begin:end] = ids[: end - begin]
        offset += segment.t * rows * cols
    return out


# -- model plumbing ------------------------------------------------------------------------------------------
def encoder_layers(adapter: Any) -> nn.ModuleList:
    """The encoder layers of a CLIP / SigLIP vision tower; ValueError for other towers."""
    tower = adapter.vision_tower
    body = getattr(tower, "vision_model", tower)
    layers = getattr(getattr(body, "encoder", None), "layers", None)
    if layers is None or not all(hasattr(layer, "layer_norm1") for layer in layers):
        raise ValueError(
            f"vflowopt needs a CLIP, SigLIP or Qwen-VL vision tower; {type(tower).__name__} is not one; "
            "use 'transprune' or 'fastv' for it."
        )
    return layers


def feature_layer_index(adapter: Any) -> int:
    """The encoder layer whose output the projector reads (``vision_feature_layer``, last one if a list)."""
    config = adapter.config
    feature = getattr(config, "vision_feature_layer", -1)
    if isinstance(feature, (list, tuple)):
        feature = feature[-1]
    depth = int(config.vision_config.num_hidden_layers)
    return depth + int(feature) if int(feature) < 0 else int(feature) - 1


def keeps_cls(adapter: Any) -> bool:
    """True when the tower emits a CLS token and the projector keeps it (``full`` strategy on CLIP)."""
    strategy = getattr(adapter.config, "vision_feature_select_strategy", "default")
    has_cls = getattr(adapter.config.vision_config, "model_type", "") != "siglip_vision_model"
    return has_cls and strategy == "full"


def crop_tokens(adapter: Any, crop_map: torch.Tensor) -> torch.Tensor:
    """Drop the CLS column of ``[n, T]`` per crop when the projector drops it (``default`` strategy)."""
    strategy = getattr(adapter.config, "vision_feature_select_strategy", "default")
    return crop_map[:, 1:] if strategy == "default" else crop_map


def arrange(adapter: Any, crops: torch.Tensor, inputs: dict, num_visual: list[int]
            ) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    """Per sample: ``[N0_b]`` values in visual-token order from per-crop values ``[n_crops, tokens]``, and the
    grids (segments) of its images, used for the recycling cells.

    LLaVA: one crop per image. LLaVA-NeXT / OneVision: base view then the tile grid arranged as the model
    packs its features (:mod:`vtprune.methods.tiles`), newline tokens 1.0 so they are never pruned (as
    in VFlowOpt). The grids come from the same layouts (the adapter's segments need ``image_sizes``, which
    ``generate`` does not pass on).
    """
    check_images_only(inputs)
    images = _tiled_images(adapter, crops, inputs) if adapter.tiled_images else _llava_images(adapter, crops)
    return distribute(images, num_visual, adapter.config.model_type)


def check_images_only(inputs: dict) -> None:
    """ValueError for a call with video (the VFlowOpt map is built for images)."""
    if inputs.get("pixel_values_videos") is not None or (inputs.get("mm_encoder_outputs") or {}).get("video"):
        raise ValueError("vflowopt supports image inputs only (no video); use 'transprune' or 'fastv' for video.")


def distribute(images: list[tuple[torch.Tensor, list[VisualSegment]]], num_visual: list[int], model_type: str
               ) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    """Per sample ``(values [N0_b], segments)`` from the call's per-image ``(values, grids)`` in batch order."""
    result, queue = [], list(images)
    for count in num_visual:
        values, segments, filled = [], [], 0
        while filled < count and queue:
            image_values, grids = queue.pop(0)
            segments += [VisualSegment(filled + g.start, g.t, g.h, g.w, g.kind, g.extra) for g in grids]
            values.append(image_values)
            filled += image_values.numel()
        if filled != count:
            raise ValueError(
                f"vflowopt could not align its vision-tower map with the {count} visual tokens of a "
                f"{model_type} sample ({filled} values); this image layout is not supported."
            )
        result.append((torch.cat(values) if values else torch.zeros(0), segments))
    return result


def _llava_images(adapter: Any, crops: torch.Tensor) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    side = adapter.config.vision_config.image_size // adapter.config.vision_config.patch_size
    extra = crops.shape[1] - side * side
    return [(crop, [VisualSegment(0, 1, side, side, extra=extra)]) for crop in crops]


def _tiled_images(adapter: Any, crops: torch.Tensor, inputs: dict) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    side = adapter.config.vision_config.image_size // adapter.config.vision_config.patch_size
    layouts = image_layouts(adapter, inputs, crops.shape[0])
    images = []
    for part, layout in zip(torch.split(crops, [x.crops for x in layouts]), layouts, strict=True):
        grids = [VisualSegment(0, 1, side, side)]
        if layout.crops == 1:
            grids.append(VisualSegment(side * side, 1, 1, 1, kind="newline"))
        else:
            grids.append(VisualSegment(side * side, 1, layout.final[0], layout.final[1] + 1, kind="tiles"))
        images.append((tile_values(part, layout, side), grids))
    return images


def pixel_statistics(adapter: Any, mean: list[float] | None, std: list[float] | None) -> tuple[list[float], list[float]]:
    """Processor ``image_mean`` / ``image_std`` used to de-normalise ``pixel_values`` for the entropy term.

    Order: the explicit options; the ``preprocessor_config.json`` / ``processor_config.json`` next to the
    model (``config._name_or_path``); else the tower's usual values (SigLIP and Qwen3-VL 0.5 / 0.5, CLIP OpenAI
    stats for CLIP, Qwen2-VL and Qwen2.5-VL).
    """
    if mean is not None and std is not None:
        return list(mean), list(std)
    folder = Path(getattr(adapter.config, "_name_or_path", "") or "/nonexistent")
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = folder / name
        if file.is_file():
            data = json.loads(file.read_text())
            data = data.get("image_processor", data)
            if "image_mean" in data and "image_std" in data:
                return list(mean or data["image_mean"]), list(std or data["image_std"])
    if getattr(adapter.config.vision_config, "model_type", "") in ("siglip_vision_model", "qwen3_vl_vision"):
        return list(mean or [0.5] * 3), list(std or [0.5] * 3)
    return (list(mean or [0.48145466, 0.4578275, 0.40821073]), list(std or [0.26862954, 0.26130258, 0.27577711]))
