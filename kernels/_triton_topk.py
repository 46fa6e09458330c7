"""Triton segmented top-k (imported lazily: defining these kernels needs triton, and on CPU ``TRITON_INTERPRET=1``).

One program per sample. The k-th largest score of the span is found by an MSD radix select over an
order-preserving 32-bit key of the fp32 score (8 passes of 4 bits; each pass streams the span in ``BLOCK``-wide
tiles and counts the candidates per digit), so any N works without holding the row in registers. A final pass
writes, in position order, every index whose key is above the threshold plus the lowest-index ties at the
threshold, which reproduces the reference tie-break (lower index wins) exactly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

RADIX_BITS = 4
BLOCK = 1024


@triton.jit
def _ordered_key(row_ptr, offs, n):
    """Load scores ``row_ptr[offs]`` (``offs < n``) and map them to uint32 keys with the same total order."""
    s = tl.load(row_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties with +0.0, as in torch
    bits = s.to(tl.uint32, bitcast=True)
    top_bit = tl.full([], 1, tl.uint32) << 31
    return tl.where((bits & top_bit) != 0, ~bits, bits | top_bit)


@triton.jit
def _segmented_topk_kernel(
    scores_ptr,
    lengths_ptr,
    k_ptr,
    out_ptr,
    stride_s,
    stride_out,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.load(lengths_ptr + b).to(tl.int32)
    kk = tl.load(k_ptr + b).to(tl.int32)
    row = scores_ptr + b.to(tl.int64) * stride_s
    out_row = out_ptr + b.to(tl.int64) * stride_out
    RADIX: tl.constexpr = 1 << RADIX_BITS
    if kk > 0:
        digits = tl.arange(0, RADIX)
        prefix = tl.full([], 0, tl.uint32)
        prefix_mask = tl.full([], 0, tl.uint32)
        remaining = kk  # rank of the threshold among the keys that still match the prefix
        for p in tl.static_range(32 // RADIX_BITS):
            shift = 32 - RADIX_BITS * (p + 1)
            hist = tl.zeros([RADIX], dtype=tl.int32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                key = _ordered_key(row, offs, n)
                match = (offs < n) & ((key & prefix_mask) == prefix)
                digit = ((key >> shift) & (RADIX - 1)).to(tl.int32)
                onehot = (digit[:, None] == digits[None, :]) & match[:, None]
                hist += tl.sum(onehot.to(tl.int32), axis=0)
            at_least = tl.cumsum(hist, axis=0, reverse=True)  # matches whose digit is >= d
            chosen = tl.max(tl.where(at_least >= remaining, digits, 0), axis=0)
            remaining -= tl.sum(tl.where(digits > chosen, hist, 0), axis=0)
            prefix = prefix | (chosen.to(tl.uint32) << shift)
            prefix_mask = prefix_mask | (tl.full([], RADIX - 1, tl.uint32) << shift)
        # prefix is now the k-th largest key; `remaining` ties at it are kept, lowest positions first.
        written = tl.full([], 0, tl.int32)
        ties_seen = tl.full([], 0, tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            key = _ordered_key(row, offs, n)
            valid = offs < n
            tie = valid & (key == prefix)
            tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            keep = (valid & (key > prefix)) | (tie & (tie_rank < remaining))
            pos = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(out_row + pos, offs.to(tl.int64), mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
            ties_seen += tl.sum(tie.to(tl.int32), axis=0)


def segmented_topk_triton(
    scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor, k_max: int
) -> torch.Tensor:
    """Launch the kernel on validated, contiguous inputs.

    Args:
        scores: ``[B, N]`` float32/float16/bfloat16, contiguous.
        lengths: ``[B]`` int64 valid span lengths.
        k: ``[B]`` int64 number to keep per sample.
        k_max: ``max(k)`` (> 0).

    Returns:
        ``[B, k_max]`` int64 indices, ascending per row, ``-1`` padded.
    """
    bsz, n_cols = scores.shape
    out = torch.full((bsz, k_max), -1, dtype=torch.long, device=scores.device)
    block = min(BLOCK, max(16, triton.next_power_of_2(n_cols)))
    _segmented_topk_kernel[(bsz,)](
        scores, lengths, k, out, scores.stride(0), out.stride(0),
        BLOCK=block, RADIX_BITS=RADIX_BITS, num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip
    return out
