"""Qwen-VL vision-tower side of VFlowOpt (arXiv:2508.05211): one ViT block's attention map, pooled through the merger.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL share the tower layout this module reads: ``visual.blocks[i]`` with ``norm1``
and ``attn.qkv`` (fused q/k/v), a 2-D rotary embedding passed to every block as ``position_embeddings``
``(cos, sin)`` ``[S, d]``, and ``cu_seqlens`` splitting the flat ``[S, D]`` patch sequence into the frames it
attends within. The tokens the language model sees are the ``m x m`` (``m = spatial_merge_size = 2``) groups of
consecutive patches that the ``PatchMerger`` concatenates.

* **Which block**: the last *full-attention* block, whose output the merger reads. Qwen2-VL and Qwen3-VL attend
  over the whole frame in every block; Qwen2.5-VL only in ``fullatt_block_indexes`` (7/15/23/31 of 32 for the
  7B) and within windows elsewhere, where the map would be block-diagonal, so windowed blocks are refused.
* **The map**: ``A = mean_h softmax(q k^T * scale)`` per frame, recomputed from the block's ``norm1`` and
  ``qkv`` on its captured input with the model's own ``apply_rotary_pos_emb_vision`` (so the tower keeps
  running SDPA / FlashAttention). ``A`` is never materialised: :func:`streamed_relevance` computes the received
  attention ``c_j = sum_i A_ij`` over query blocks, then only the rows of ``K = {j : c_j > t}``, so memory is
  ``O(H * block * T)`` for a ``T``-patch frame (``T`` reaches 16k on large images).
* **To LLM tokens**: the per-patch importance is averaged over each merge group of ``m^2`` consecutive
  patches (VFlowOpt spec 4.7: "pooled over each 2x2 merge group"); Qwen2.5-VL's blocks see the patches
  permuted into windows (``window_index``, in merge-group units), so the pooled map is put back in the
  merger's output order with ``argsort(window_index)``, as the tower does with its features.
* **Entropy term**: each ``pixel_values`` row is one patch ``(C, temporal, P, P)`` in the merger's order (not
  windowed); its first temporal slice is de-normalised and histogrammed (:mod:`vtprune.methods.entropy`),
  ``softmax(H)`` runs over the image's patches and is pooled like the relevance (pooling is linear).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vtprune.adapters.base import VisualSegment
from vtprune.config import stage_layer
from vtprune.methods.entropy import denormalize, entropy_weights, patch_entropy

QUERY_BLOCK = 1024


# -- pure functions ----------------------------------------------------------------------------------------
def head_mean_softmax(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
    """``mean_h softmax(q k^T scale)`` ``[Q, T]`` (fp32). query: ``[H, Q, d]``; key: ``[H, T, d]``."""
    return torch.softmax((query.float() @ key.float().transpose(-1, -2)) * scale, dim=-1).mean(dim=0)


def streamed_relevance(query: torch.Tensor, key: torch.Tensor, scale: float, threshold: float,
                       block: int = QUERY_BLOCK) -> torch.Tensor:
    """VFlowOpt's context relevance ``[T]`` of one frame without the ``T x T`` map (equals
    ``context_relevance(A[None], threshold)[0]`` with ``A`` = :func:`head_mean_softmax` of all queries).

    query, key: ``[H, T, d]``. Pass 1 sums the received attention ``c_j`` over ``block`` queries at a time;
    pass 2 averages the rows of the high-receipt set ``K = {j : c_j > threshold}`` (all rows if ``K`` is empty).
    """
    length = query.shape[1]
    received = torch.zeros(length, dtype=torch.float32, device=query.device)
    for start in range(0, length, block):
        received += head_mean_softmax(query[:, start:start + block], key, scale).sum(dim=0)
    chosen = (received > threshold).nonzero().flatten()
    if chosen.numel() == 0:
        chosen = torch.arange(length, device=query.device)
    total = torch.zeros(length, dtype=torch.float32, device=query.device)
    for start in range(0, chosen.numel(), block):
        total += head_mean_softmax(query[:, chosen[start:start + block]], key, scale).sum(dim=0)
    return total / chosen.numel()


def pool_groups(values: torch.Tensor, unit: int) -> torch.Tensor:
    """Mean of each run of ``unit`` consecutive values: ``[S]`` -> ``[S / unit]`` (one LLM token per merge group)."""
    if values.shape[0] % unit:
        raise ValueError(f"{values.shape[0]} patches do not form whole merge groups of {unit}.")
    return values.reshape(-1, unit).mean(dim=1)


def in_token_order(values: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``[M]`` merge-group values from the order the blocks see them (Qwen2.5-VL: windows) to the merger's
    output order; ``order`` = ``argsort(window_index)`` (the adapter's ``vit_merged_order``), None: unchanged."""
    return values if order is None else values[order.to(values.device)]


# -- model plumbing (the adapter's ``vit_blocks``, ``vit_full_attention_blocks``, ``vit_merged_order``) -----------
def choose_block(adapter: Any, requested: int | None) -> int:
    """``requested`` (checked to be a full-attention block) or the last full-attention block."""
    allowed = adapter.vit_full_attention_blocks()
    if not allowed:
        raise ValueError(f"{adapter.config.model_type}'s vision tower has no full-attention block; vflowopt cannot "
                         "build its map: use 'transprune' or 'fastv'.")
    if requested is None:
        return allowed[-1]
    requested = stage_layer(requested, "vit_layer")
    if requested not in allowed:
        raise ValueError(
            f"vit_layer={requested} is not a full-attention block of this {adapter.config.model_type} tower (windowed "
            f"blocks give a block-diagonal map); use one of {allowed} (None: the last one, {allowed[-1]})."
        )
    return int(requested)


def block_qk(block: nn.Module, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[H, S, d]`` (fp32) of a Qwen-VL ViT block, after its 2-D rotary embedding.

    hidden: ``[S, D]`` the block's input; position_embeddings: the block's ``(cos, sin)`` ``[S, d]``.
    """
    attention = block.attn
    heads, length = int(attention.num_heads), hidden.shape[0]
    qkv = attention.qkv(block.norm1(hidden)).reshape(length, 3, heads, -1).permute(1, 0, 2, 3)
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb_vision
    cos, sin = (t.to(hidden.device) for t in position_embeddings)
    query, key = rotary(qkv[0], qkv[1], cos, sin)
    return query.transpose(0, 1).float(), key.transpose(0, 1).float()


def image_maps(adapter: Any, block: nn.Module, hidden: torch.Tensor, kwargs: dict, grid_thw: torch.Tensor,
               threshold: Callable[[int], float]) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    """Per image of the tower call: its LLM tokens' relevance ``[t h w / m^2]`` and its merged grid.

    hidden: ``[S, D]`` the block's input; kwargs: its ``cu_seqlens`` and ``position_embeddings``;
    ``threshold(T)``: the high-receipt threshold for a frame of ``T`` patches.
    """
    unit = adapter.merge_size ** 2
    bounds = kwargs["cu_seqlens"].tolist()
    query, key = block_qk(block, hidden, kwargs["position_embeddings"])
    scale = float(getattr(block.attn, "scaling", query.shape[-1] ** -0.5))
    frames = [streamed_relevance(query[:, a:b], key[:, a:b], scale, threshold(b - a))
              for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    merged = in_token_order(pool_groups(torch.cat(frames), unit), adapter.vit_merged_order(grid_thw))
    return split_images(merged, grid_thw, adapter.merge_size)


def split_images(merged: torch.Tensor, grid_thw: torch.Tensor, side: int
                 ) -> list[tuple[torch.Tensor, list[VisualSegment]]]:
    """``[M]`` merged values of all images -> per image ``(values, [VisualSegment(0, t, h/m, w/m)])``."""
    grids = [(int(t), int(h) // side, int(w) // side) for t, h, w in grid_thw.tolist()]
    parts = torch.split(merged, [t * h * w for t, h, w in grids])
    return [(part, [VisualSegment(0, t, h, w)]) for part, (t, h, w) in zip(parts, grids, strict=True)]


def pixel_entropy_map(pixels: torch.Tensor, grid_thw: torch.Tensor, stats: tuple, patch: int, unit: int
                      ) -> torch.Tensor:
    """``softmax(H)`` per image, pooled per merge group: ``[M]`` in the merger's order.

    pixels: ``[S, C * temporal * P * P]`` the processor's patch rows (merger order, ``C = 3``).
    """
    rows = pixels.reshape(pixels.shape[0], 3, -1, patch, patch)[:, :, 0].float()
    rgb = denormalize(rows, *stats)
    entropy = patch_entropy(rgb, patch)[:, 0]
    sizes = [int(t) * int(h) * int(w) for t, h, w in grid_thw.tolist()]
    weights = torch.cat([entropy_weights(part[None])[0] for part in torch.split(entropy, sizes)])
    return pool_groups(weights, unit)

