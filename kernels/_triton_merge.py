"""Triton weighted segment mean (imported lazily; on CPU needs ``TRITON_INTERPRET=1`` before import).

Pass 1 (scatter): one program per ``(sample, token tile, feature tile)`` loads ``[BLOCK_N, BLOCK_D]`` of ``x``,
scales it by the token weights in fp32 and ``atomic_add``s each row into its target's fp32 accumulator
(``[B, T, D]``); the ``d``-tile 0 programs also add the weights into ``[B, T]`` sums. Pass 2 (finalize) divides
and casts to ``x.dtype``. fp32 atomics make the summation order, hence the last bits, run-dependent.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _merge_scatter_kernel(
    x_ptr, assign_ptr, weight_ptr, acc_ptr, wsum_ptr,
    N, D, T, tiles_n,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = (pid // tiles_n).to(tl.int64)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D
    tgt = tl.load(assign_ptr + b * N + offs_n, mask=mask_n, other=-1).to(tl.int64)
    w = tl.load(weight_ptr + b * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    keep = mask_n & (tgt >= 0)
    tile_mask = keep[:, None] & mask_d[None, :]
    rows = b * N + offs_n
    x = tl.load(x_ptr + rows[:, None] * D + offs_d[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    dst = acc_ptr + (b * T + tgt)[:, None] * D + offs_d[None, :]
    tl.atomic_add(dst, x * w[:, None], mask=tile_mask, sem="relaxed")
    if pid_d == 0:
        tl.atomic_add(wsum_ptr + b * T + tgt, w, mask=keep, sem="relaxed")


@triton.jit
def _merge_finalize_kernel(
    acc_ptr, wsum_ptr, out_ptr, R, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (offs_r < R)[:, None] & (offs_d < D)[None, :]
    wsum = tl.load(wsum_ptr + offs_r, mask=offs_r < R, other=0.0)
    inv = tl.where(wsum > 0.0, 1.0 / tl.where(wsum > 0.0, wsum, 1.0), 0.0)
    idx = offs_r.to(tl.int64)[:, None] * D + offs_d[None, :]
    acc = tl.load(acc_ptr + idx, mask=mask, other=0.0)
    tl.store(out_ptr + idx, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def merge_tokens_triton(
    x: torch.Tensor, assign: torch.Tensor, weight: torch.Tensor, num_targets: int
) -> torch.Tensor:
    """Launch scatter + finalize on validated, contiguous, non-empty inputs.

    Args:
        x: ``[B, N, D]`` float32/float16/bfloat16.
        assign: ``[B, N]`` integer targets in ``[-1, T)``.
        weight: ``[B, N]`` float weights ``>= 0``.
        num_targets: ``T >= 1``.

    Returns:
        ``[B, T, D]`` in ``x.dtype``.
    """
    bsz, n_tok, dim = x.shape
    acc = torch.zeros(bsz, num_targets, dim, dtype=torch.float32, device=x.device)
    wsum = torch.zeros(bsz, num_targets, dtype=torch.float32, device=x.device)
    block_n = min(16, triton.next_power_of_2(n_tok))
    block_d = min(128, triton.next_power_of_2(dim))
    tiles_n = triton.cdiv(n_tok, block_n)
    grid = (bsz * tiles_n, triton.cdiv(dim, block_d))
    _merge_scatter_kernel[grid](
        x, assign, weight, acc, wsum, n_tok, dim, num_targets, tiles_n, BLOCK_N=block_n, BLOCK_D=block_d
    )
    out = torch.empty_like(acc, dtype=x.dtype)
    rows = bsz * num_targets
    block_r = min(16, triton.next_power_of_2(rows))
    grid = (triton.cdiv(rows, block_r), triton.cdiv(dim, block_d))
    _merge_finalize_kernel[grid](acc, wsum, out, rows, dim, BLOCK_R=block_r, BLOCK_D=block_d)
    return out
