"""Segmented (ragged) top-k over per-sample score spans.

Ordering contract shared by every implementation: scores are compared as numbers, ``+inf`` ranks highest and
``-inf`` lowest, ``-0.0`` equals ``+0.0``, and ties are broken towards the lower position. NaN inside a valid
span is rejected. The selected positions are returned in ascending order, ``-1`` padded.
"""

from __future__ import annotations

import torch

from ._dispatch import device_guard, load_triton_module, resolve_impl

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU_LOOP_NUMEL = 65536  # CPU fallback: above this many scores the python loop beats the batched sort


def _validate(scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the offending value when the inputs break the contract."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a [B, N] tensor, got {shape}; reshape it to [batch, tokens].")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}; cast with scores.float().")
    bsz, n_cols = scores.shape
    for name, t in (("lengths", lengths), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.shape != (bsz,):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape [B]=[{bsz}], got {shape}; pass one value per sample.")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}; use torch.long.")
        if t.device != scores.device:
            raise ValueError(f"{name} is on {t.device} but scores on {scores.device}; move it with .to().")
    if bsz == 0:
        return
    checks = (
        (lengths < 0, lengths, "lengths[{b}]={v} is negative; lengths count the valid tokens of each sample"),
        (lengths > n_cols, lengths, "lengths[{b}]={v} exceeds N={n}; lengths must be <= scores.shape[1]"),
        (k < 0, k, "k[{b}]={v} is negative; pass k >= 0"),
        (k > lengths, k, "k[{b}]={v} exceeds lengths[{b}]={lb}; clamp k with torch.minimum(k, lengths)"),
    )
    for bad, values, msg in checks:
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(msg.format(b=b, v=int(values[b]), n=n_cols, lb=int(lengths[b])))
    in_span = torch.arange(n_cols, device=scores.device)[None, :] < lengths[:, None]
    nan_rows = (torch.isnan(scores) & in_span).any(dim=1)
    if bool(nan_rows.any()):
        b = int(nan_rows.nonzero()[0, 0])
        raise ValueError(
            f"scores of sample {b} contain NaN inside its valid span (first {int(lengths[b])} tokens); "
            "replace them, e.g. torch.nan_to_num(scores, nan=float('-inf'))."
        )


def segmented_topk_torch_loop(scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Reference: one stable descending sort per sample in a Python loop (no validation).

    Args:
        scores: ``[B, N]`` float scores.
        lengths: ``[B]`` int valid span length per sample.
        k: ``[B]`` int number of positions to keep per sample (``k[b] <= lengths[b]``).

    Returns:
        ``[B, max(k)]`` int64 positions, ascending per row, ``-1`` padded.
    """
    k_max = int(k.max()) if k.numel() else 0
    out = torch.full((scores.shape[0], k_max), -1, dtype=torch.long, device=scores.device)
    for b in range(scores.shape[0]):
        n_b, k_b = int(lengths[b]), int(k[b])
        span = scores[b, :n_b]
        span = torch.where(span == 0, torch.zeros_like(span), span)  # -0.0 == +0.0
        order = torch.sort(span, descending=True, stable=True).indices[:k_b]
        out[b, :k_b] = torch.sort(order).values
    return out


def segmented_topk_torch(scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor,
                         k_max: int | None = None) -> torch.Tensor:
    """Vectorised torch version of :func:`segmented_topk_torch_loop` (same result, one batched stable sort).

    Padding is filled with ``-inf``; a stable sort ranks it after any valid ``-inf`` (padding sits at higher
    positions) and ``k[b] <= lengths[b]`` keeps it out of the selection.
    """
    bsz, n_cols = scores.shape
    if k_max is None:
        k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return torch.empty((bsz, 0), dtype=torch.long, device=scores.device)
    pos = torch.arange(n_cols, device=scores.device)
    s = scores.masked_fill(pos[None, :] >= lengths[:, None], float("-inf"))
    s = torch.where(s == 0, torch.zeros_like(s), s)
    top = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k_max]
    slot = torch.arange(k_max, device=scores.device)[None, :]
    top = torch.where(slot < k[:, None], top, torch.full_like(top, n_cols))
    top = torch.sort(top, dim=1).values
    return torch.where(top == n_cols, torch.full_like(top, -1), top)


def segmented_topk(
    scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor, impl: str = "auto",
    k_max: int | None = None, check: bool = True,
) -> torch.Tensor:
    """Per sample ``b``, the positions of the ``k[b]`` highest scores among ``scores[b, :lengths[b]]``.

    Args:
        scores: ``[B, N]`` float scores; positions ``>= lengths[b]`` are padding and never selected.
        lengths: ``[B]`` integer valid span lengths (``0 <= lengths[b] <= N``).
        k: ``[B]`` integer counts to keep (``0 <= k[b] <= lengths[b]``).
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (see :mod:`vtprune.kernels._dispatch`).
        k_max: ``max(k)`` when the caller knows it on the host (saves a device sync).
        check: validate the inputs (each check reads a device value); the engine, which builds valid
            inputs, passes False.

    Returns:
        ``[B, K_max]`` int64 with ``K_max = max(k)``: row ``b`` holds ``k[b]`` positions in ascending order
        followed by ``-1``. Ties go to the lower position; ``+inf`` ranks highest, ``-inf`` lowest.

    Raises:
        ValueError: bad shapes/dtypes, ``k`` outside ``[0, lengths]``, ``lengths`` outside ``[0, N]``, or NaN in
            a valid span (the message names the sample).
    """
    if check:
        _validate(scores, lengths, k)
    scores = scores.contiguous()
    lengths = lengths.to(torch.long).contiguous()
    k = k.to(torch.long).contiguous()
    if k_max is None:
        k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device)
    if resolve_impl(impl, scores.device, scores.dtype in TRITON_DTYPES) == "triton":
        with device_guard(scores.device):
            return load_triton_module("_triton_topk").segmented_topk_triton(scores, lengths, k, k_max)
    # Fallback: one batched sort on GPU; on CPU the per-sample loop is faster for large problems (measured).
    if scores.device.type == "cpu" and scores.numel() > CPU_LOOP_NUMEL:
        return segmented_topk_torch_loop(scores, lengths, k)
    return segmented_topk_torch(scores, lengths, k, k_max)
