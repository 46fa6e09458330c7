"""Weighted segment mean: merge tokens into targets (ToMe size-weighted average, VFlowOpt grid recycling).

``out[b, t] = sum_{i: assign[b,i]==t} weight[b,i] * x[b,i] / sum_{i: assign[b,i]==t} weight[b,i]``.
``assign == -1`` drops a token. A target with zero total weight (no token, or only zero weights) is 0.
Every implementation is a single scatter pass into fp32 accumulators of size ``[B, T, D]`` (never ``N x N`` or
``T x N``) and returns ``x.dtype``.
"""

from __future__ import annotations

import torch

from ._dispatch import device_guard, load_triton_module, resolve_impl

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _validate(x: torch.Tensor, assign: torch.Tensor, weight: torch.Tensor, num_targets: int,
              values: bool = True) -> None:
    """Raise ``ValueError`` naming the offending value when the inputs break the contract."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        desc = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating [B, N, D] tensor, got {desc}; reshape/cast it.")
    bsz, n_tok, _ = x.shape
    if isinstance(num_targets, bool) or not isinstance(num_targets, int) or num_targets < 0:
        raise ValueError(f"num_targets must be an int >= 0, got {num_targets!r}; pass int(T).")
    for name, t in (("assign", assign), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.shape != (bsz, n_tok):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape [B, N]=[{bsz}, {n_tok}], got {shape}.")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x on {x.device}; move it with .to().")
    if assign.is_floating_point() or assign.is_complex() or assign.dtype == torch.bool:
        raise ValueError(f"assign must be an integer tensor, got {assign.dtype}; use torch.long.")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}; use weight.float().")
    if assign.numel() == 0 or not values:
        return
    bad = (assign < -1) | (assign >= num_targets)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"assign[{b}, {i}]={int(assign[b, i])} is outside [-1, num_targets={num_targets}); "
            "use -1 to drop a token and 0..T-1 for targets."
        )
    used = assign >= 0
    bad = used & ~(weight >= 0)  # also catches NaN
    bad |= used & torch.isinf(weight)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"weight[{b}, {i}]={float(weight[b, i])} is negative or not finite; weights must be finite and >= 0 "
            "(e.g. token sizes, or 1 for a plain mean)."
        )


def merge_tokens_torch(
    x: torch.Tensor, assign: torch.Tensor, weight: torch.Tensor, num_targets: int
) -> torch.Tensor:
    """Reference: fp32 ``index_add_`` into ``B * (T + 1)`` rows (row ``T`` of each sample collects drops).

    Args:
        x: ``[B, N, D]`` tokens.
        assign: ``[B, N]`` int target per token in ``[-1, T)``.
        weight: ``[B, N]`` float non-negative weights.
        num_targets: ``T``.

    Returns:
        ``[B, T, D]`` in ``x.dtype``.
    """
    bsz, n_tok, dim = x.shape
    slots = num_targets + 1
    a = torch.where(assign < 0, torch.full_like(assign, num_targets), assign).long()
    flat = (a + torch.arange(bsz, device=x.device)[:, None] * slots).reshape(-1)
    w = weight.float().reshape(-1)
    acc = torch.zeros(bsz * slots, dim, dtype=torch.float32, device=x.device)
    acc.index_add_(0, flat, x.reshape(-1, dim).float() * w[:, None])
    wsum = torch.zeros(bsz * slots, dtype=torch.float32, device=x.device).index_add_(0, flat, w)
    out = torch.where(wsum[:, None] > 0, acc / wsum.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return out.view(bsz, slots, dim)[:, :num_targets].to(x.dtype)


def merge_tokens(
    x: torch.Tensor, assign: torch.Tensor, weight: torch.Tensor, num_targets: int, impl: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Weighted mean of the tokens assigned to each target.

    Args:
        x: ``[B, N, D]`` float tokens (any float dtype; accumulation is fp32).
        assign: ``[B, N]`` integer target of each token in ``[0, T)``, or ``-1`` to drop it.
        weight: ``[B, N]`` float weights ``>= 0`` (e.g. ToMe token sizes); ignored for dropped tokens.
        num_targets: ``T``, the number of output tokens per sample.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``.
        check: validate the values of ``assign`` and ``weight`` (reads them back: a host-device sync); shapes
            and dtypes are always checked. Pass False on a hot path whose inputs are valid by construction.

    Returns:
        ``[B, T, D]`` in ``x.dtype``; a target whose total weight is 0 is all zeros.

    Raises:
        ValueError: bad shapes/dtypes, ``assign`` outside ``[-1, T)``, negative or non-finite weights.
    """
    _validate(x, assign, weight, num_targets, values=check)
    bsz, n_tok, dim = x.shape
    if num_targets == 0 or n_tok == 0 or bsz == 0 or dim == 0:
        return torch.zeros(bsz, num_targets, dim, dtype=x.dtype, device=x.device)
    x, assign, weight = x.contiguous(), assign.contiguous(), weight.contiguous()
    if resolve_impl(impl, x.device, x.dtype in TRITON_DTYPES) == "triton":
        with device_guard(x.device):
            return load_triton_module("_triton_merge").merge_tokens_triton(x, assign, weight, num_targets)
    return merge_tokens_torch(x, assign, weight, num_targets)
