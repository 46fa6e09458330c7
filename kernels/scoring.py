"""Attention received by every key, averaged over heads and valid queries (FastV-style visual token scores).

For sample ``b``, head ``h`` and query ``q`` at position ``p = query_positions[b, q]`` the model's attention row is
``softmax_l(scaling * <query[b,h,q], key[b,h//G,l]>)`` over the keys it may see: ``l <= p`` (key ``l`` sits at
position ``l`` of the key axis) and ``key_valid[b, l]``. The result is
``out[b, l] = sum_{h, valid q} attn[b,h,q,l] / (H * n_valid_queries[b])``. Conventions: a query that sees no key
contributes a zero row; a sample without valid queries gets an all-zero row.
"""

from __future__ import annotations

import torch

from ._dispatch import device_guard, load_triton_module, resolve_impl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_CHUNK_BYTES = 256 * 2**20  # bound on the fp32 [B, heads, Q, L] block the torch reference holds at once


def _validate(query, key, query_positions, key_valid, query_valid, scaling, values: bool = True) -> None:  # noqa: ANN001
    """Raise ``ValueError`` naming the offending value when the inputs break the contract."""
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, heads, len, head_dim], got {shape}.")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use float16, bfloat16 or float32.")
    bsz, n_heads, n_q, head_dim = query.shape
    kb, n_kv, n_keys, kd = key.shape
    if query.dtype != key.dtype:
        raise ValueError(f"query is {query.dtype} but key is {key.dtype}; cast one to the other.")
    if kb != bsz or kd != head_dim:
        raise ValueError(
            f"key shape {tuple(key.shape)} does not match query {tuple(query.shape)} in B or head_dim."
        )
    if key.device != query.device:
        raise ValueError(f"key is on {key.device} but query on {query.device}; move it with .to().")
    if n_q < 1 or n_keys < 1 or n_kv < 1:
        raise ValueError(f"need Q >= 1, L >= 1 and H_kv >= 1, got Q={n_q}, L={n_keys}, H_kv={n_kv}.")
    if n_heads % n_kv:
        raise ValueError(
            f"H={n_heads} query heads is not a multiple of H_kv={n_kv} key heads (grouped-query attn)."
        )
    if scaling is not None and not (isinstance(scaling, (int, float)) and abs(float(scaling)) < float("inf")):
        raise ValueError(f"scaling={scaling!r} must be a finite float or None (None means head_dim**-0.5).")
    for name, t, shape, want_bool in (
        ("query_positions", query_positions, (bsz, n_q), False),
        ("key_valid", key_valid, (bsz, n_keys), True),
        ("query_valid", query_valid, (bsz, n_q), True),
    ):
        if t is None and want_bool:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape {list(shape)}, got {got}.")
        if want_bool and t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got {t.dtype}; use mask.bool().")
        if not want_bool and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}; use torch.long.")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query on {query.device}; move it with .to().")
    if not values:
        return
    qv = torch.ones_like(query_positions, dtype=torch.bool) if query_valid is None else query_valid
    bad = qv & ((query_positions < 0) | (query_positions >= n_keys))
    if bool(bad.any()):
        b, q = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"query_positions[{b}, {q}]={int(query_positions[b, q])} is outside [0, L={n_keys}); positions index "
            "the key axis (mark padding queries invalid with query_valid)."
        )


def _query_weights(
    query_positions: torch.Tensor, query_valid: torch.Tensor | None, n_heads: int
) -> torch.Tensor:
    """``[B, Q]`` fp32 weight of each (query, head) row: ``valid / (H * n_valid)``, 0 for invalid queries."""
    qv = torch.ones_like(query_positions, dtype=torch.float32) if query_valid is None else query_valid.float()
    return qv / (n_heads * qv.sum(dim=1, keepdim=True)).clamp_min(1.0)


def _visible(query_positions: torch.Tensor, key_valid: torch.Tensor | None, n_keys: int) -> torch.Tensor:
    """``[B, Q, L]`` bool: key ``l`` is visible to query ``q`` (causal and valid)."""
    pos = torch.arange(n_keys, device=query_positions.device)
    vis = pos[None, None, :] <= query_positions[:, :, None]
    return vis if key_valid is None else vis & key_valid[:, None, :]


def visual_attention_scores_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    query_valid: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """Reference (eager softmax): materialise fp32 ``[B, heads, Q, L]`` per chunk of kv heads.

    Args:
        query: ``[B, H, Q, d]``; key: ``[B, H_kv, L, d]``; query_positions: ``[B, Q]`` int;
        key_valid: ``[B, L]`` bool or None; query_valid: ``[B, Q]`` bool or None; scaling: softmax scale.

    Returns:
        ``[B, L]`` float32.
    """
    bsz, n_heads, n_q, head_dim = query.shape
    n_kv, n_keys = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    vis = _visible(query_positions, key_valid, n_keys)  # [B, Q, L]
    vis_rows = vis.repeat(1, group, 1)[:, None]  # [B, 1, G*Q, L], row g*Q+q
    seen = vis_rows.any(dim=-1, keepdim=True)
    coef = _query_weights(query_positions, query_valid, n_heads).repeat(1, group)[:, None, :]  # [B, 1, G*Q]
    q_all = query.reshape(bsz, n_kv, group * n_q, head_dim)
    per_kv = bsz * group * n_q * n_keys * 4
    chunk = max(1, TORCH_CHUNK_BYTES // max(per_kv, 1))
    out = torch.zeros(bsz, n_keys, dtype=torch.float32, device=query.device)
    for k0 in range(0, n_kv, chunk):
        q = q_all[:, k0 : k0 + chunk].float()
        k = key[:, k0 : k0 + chunk].float()
        s = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, c, G*Q, L]
        p = torch.softmax(s.masked_fill(~vis_rows, float("-inf")), dim=-1)
        p = torch.where(seen, p, 0.0)
        out += torch.einsum("bcrl,bcr->bl", p, coef.expand(-1, p.shape[1], -1))
    return out


def visual_attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    query_valid: torch.Tensor | None = None,
    scaling: float | None = None,
    impl: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Softmax attention each key receives, averaged over heads and valid queries.

    Args:
        query: ``[B, H, Q, d]`` float16/bfloat16/float32 queries (RoPE applied).
        key: ``[B, H_kv, L, d]`` keys, same dtype; query head ``h`` uses kv head ``h // (H // H_kv)``.
        query_positions: ``[B, Q]`` integer position of each query on the key axis; it sees keys ``<=`` it.
        key_valid: ``[B, L]`` bool, False masks a key (padding); None means all valid.
        query_valid: ``[B, Q]`` bool, False excludes a query from the average; None means all valid.
        scaling: softmax scale, default ``d ** -0.5``.
        impl: ``"auto"``, ``"triton"`` or ``"torch"``.
        check: also check the query positions' values (reads a device value; shapes and dtypes are always
            checked). The engine, which builds valid positions, passes False.

    Returns:
        ``[B, L]`` float32; each row sums to 1 when the sample has a valid query that sees a key.

    Raises:
        ValueError: bad shapes/dtypes, ``H % H_kv != 0``, ``Q < 1``, or a valid query position outside ``[0, L)``.
    """
    _validate(query, key, query_positions, key_valid, query_valid, scaling, values=check)
    scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
    query, key = query.contiguous(), key.contiguous()
    query_positions = query_positions.to(torch.long).contiguous()
    if resolve_impl(impl, query.device) == "triton":
        mod = load_triton_module("_triton_scoring")
        coef = _query_weights(query_positions, query_valid, query.shape[1])
        with device_guard(query.device):
            return mod.visual_attention_scores_triton(query, key, query_positions, key_valid, coef, scale)
    return visual_attention_scores_torch(query, key, query_positions, key_valid, query_valid, scale)
