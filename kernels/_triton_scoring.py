"""Triton two-pass attention-received scores (imported lazily; on CPU needs ``TRITON_INTERPRET=1``).

Pass 1 (stats): programs over ``(b, h, query tile, key split)`` stream key tiles with an online softmax and store
the row max ``m`` and sum ``l`` (base-2 domain) of their split; a tiny torch combine merges the splits
(flash-decoding style, so B=1/Q=1 still fills the GPU). Pass 2 (accumulate): programs over
``(b, kv head, key tile)`` load the key tile once, loop over the query heads of the group and the query tiles,
recompute the logits and add ``coef[q] * exp2(s - m) / l`` per key into per-``(b, kv head)`` partials
``[B, H_kv, L]``, then summed by torch (deterministic, no atomics). Nothing of size ``[B, H, Q, L]`` is stored.
Limits: one key tile of ``BLOCK_D = next_pow2(head_dim)`` columns lives in registers, so head_dim <= 256.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

BLOCK_Q = 16
BLOCK_L = 64
NEG = tl.constexpr(-1.0e30)  # finite "-inf" for running maxima: exp2(NEG - NEG) stays 1, never NaN


@triton.jit
def _load_rows(ptr, row0, offs_r, n_rows, offs_d, head_dim, UPCAST: tl.constexpr):
    """Load ``[len(offs_r), BLOCK_D]`` rows ``row0 + offs_r`` of a ``[*, head_dim]`` matrix (zeros outside)."""
    mask = (offs_r < n_rows)[:, None] & (offs_d < head_dim)[None, :]
    tile = tl.load(
        ptr + (row0 + offs_r.to(tl.int64))[:, None] * head_dim + offs_d[None, :], mask=mask, other=0.0
    )
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _logits(q, k_tile, qpos, offs_l, kvalid, n_keys, qk_scale, PRECISION: tl.constexpr):
    """Base-2 logits ``[BQ, BL]`` with invisible (acausal, invalid, out-of-range) keys at ``-inf``."""
    s = tl.dot(q, tl.trans(k_tile), input_precision=PRECISION) * qk_scale
    vis = (offs_l[None, :] <= qpos[:, None]) & ((offs_l < n_keys) & kvalid)[None, :]
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, pos_ptr, kvalid_ptr, m_ptr, l_ptr,
    H, Q, L, HEAD_DIM, GROUP, SPLITS, blocks_per_split, qk_scale,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    split = tl.program_id(2)
    b = bh // H
    kv_row0 = (b * (H // GROUP) + (bh % H) // GROUP).to(tl.int64) * L
    offs_q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr, bh.to(tl.int64) * Q, offs_q, Q, offs_d, HEAD_DIM, UPCAST)
    qpos = tl.load(pos_ptr + b * Q + offs_q, mask=offs_q < Q, other=-1).to(tl.int32)
    lo = split * blocks_per_split * BLOCK_L
    hi = tl.minimum(tl.minimum(L, tl.max(qpos, axis=0) + 1), lo + blocks_per_split * BLOCK_L)
    m = tl.full([BLOCK_Q], NEG, dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_L):
        offs_l = start + tl.arange(0, BLOCK_L)
        kvalid = tl.load(kvalid_ptr + b * L + offs_l, mask=offs_l < L, other=0) != 0
        k_tile = _load_rows(k_ptr, kv_row0, offs_l, L, offs_d, HEAD_DIM, UPCAST)
        s = _logits(q, k_tile, qpos, offs_l, kvalid, L, qk_scale, PRECISION)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        acc = acc * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    out = (bh.to(tl.int64) * Q + offs_q) * SPLITS + split
    tl.store(m_ptr + out, m, mask=offs_q < Q)
    tl.store(l_ptr + out, acc, mask=offs_q < Q)


@triton.jit
def _accumulate_kernel(
    q_ptr, k_ptr, pos_ptr, kvalid_ptr, m_ptr, l_ptr, coef_ptr, part_ptr,
    H, Q, L, HEAD_DIM, GROUP, qk_scale,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    bk = tl.program_id(0)  # b * H_kv + kv head
    b = bk // (H // GROUP)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    kvalid = tl.load(kvalid_ptr + b * L + offs_l, mask=offs_l < L, other=0) != 0
    k_tile = _load_rows(k_ptr, bk.to(tl.int64) * L, offs_l, L, offs_d, HEAD_DIM, UPCAST)
    total = tl.zeros([BLOCK_L], dtype=tl.float32)
    for g in range(GROUP):
        bh = (b * H + (bk % (H // GROUP)) * GROUP + g).to(tl.int64)
        for q0 in range(0, Q, BLOCK_Q):
            offs_q = q0 + tl.arange(0, BLOCK_Q)
            mask_q = offs_q < Q
            qpos = tl.load(pos_ptr + b * Q + offs_q, mask=mask_q, other=-1).to(tl.int32)
            q = _load_rows(q_ptr, bh * Q, offs_q, Q, offs_d, HEAD_DIM, UPCAST)
            m = tl.load(m_ptr + bh * Q + offs_q, mask=mask_q, other=0.0)
            denom = tl.load(l_ptr + bh * Q + offs_q, mask=mask_q, other=0.0)
            coef = tl.load(coef_ptr + b * Q + offs_q, mask=mask_q, other=0.0)
            w = tl.where(denom > 0.0, coef / tl.where(denom > 0.0, denom, 1.0), 0.0)
            s = _logits(q, k_tile, qpos, offs_l, kvalid, L, qk_scale, PRECISION)
            total += tl.sum(tl.exp2(s - m[:, None]) * w[:, None], axis=0)
    tl.store(part_ptr + bk.to(tl.int64) * L + offs_l, total, mask=offs_l < L)


def _default_splits(device: torch.device, programs: int, key_blocks: int) -> int:
    """Key splits for pass 1 so that about two waves of programs cover the GPU (1 on CPU/interpreter)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(key_blocks, math.ceil(2 * sms / max(programs, 1))))


def visual_attention_scores_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    coef: torch.Tensor,
    scaling: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Launch stats + accumulate on validated inputs.

    Args:
        query: ``[B, H, Q, d]`` contiguous; key: ``[B, H_kv, L, d]`` contiguous, same dtype.
        query_positions: ``[B, Q]`` int64; key_valid: ``[B, L]`` bool or None.
        coef: ``[B, Q]`` fp32 weight per query row (``valid / (H * n_valid)``).
        scaling: softmax scale. num_splits: key splits of pass 1 (default: sized to the GPU).

    Returns:
        ``[B, L]`` float32.
    """
    bsz, n_heads, n_q, head_dim = query.shape
    n_kv, n_keys = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    dev = query.device
    kvalid = (
        torch.ones(bsz, n_keys, dtype=torch.uint8, device=dev)
        if key_valid is None
        else key_valid.to(torch.uint8)
    ).contiguous()
    coef = coef.to(device=dev, dtype=torch.float32).contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    key_blocks = triton.cdiv(n_keys, BLOCK_L)
    q_tiles = triton.cdiv(n_q, BLOCK_Q)
    splits = num_splits or _default_splits(dev, bsz * n_heads * q_tiles, key_blocks)
    splits = max(1, min(int(splits), key_blocks))
    per_split = triton.cdiv(key_blocks, splits)
    qk_scale = scaling * math.log2(math.e)
    m_parts = torch.empty(bsz, n_heads, n_q, splits, dtype=torch.float32, device=dev)
    l_parts = torch.empty_like(m_parts)
    upcast = INTERPRETED  # the interpreter computes bf16 wrongly: do all math in fp32 there
    precision = "ieee" if upcast or query.dtype == torch.float32 else "tf32"  # fp32 dots: no TF32 rounding
    consts = dict(BLOCK_Q=BLOCK_Q, BLOCK_L=BLOCK_L, BLOCK_D=block_d, UPCAST=upcast, PRECISION=precision)
    _stats_kernel[(bsz * n_heads, q_tiles, splits)](
        query, key, query_positions, kvalid, m_parts, l_parts,
        n_heads, n_q, n_keys, head_dim, group, splits, per_split, qk_scale, **consts,
    )  # fmt: skip
    m = m_parts.amax(dim=-1)
    denom = (l_parts * torch.exp2(m_parts - m[..., None])).sum(dim=-1)
    partials = torch.empty(bsz, n_kv, n_keys, dtype=torch.float32, device=dev)
    _accumulate_kernel[(bsz * n_kv, key_blocks)](
        query, key, query_positions, kvalid, m.contiguous(), denom.contiguous(), coef, partials,
        n_heads, n_q, n_keys, head_dim, group, qk_scale, **consts,
    )  # fmt: skip
    return partials.sum(dim=1)
