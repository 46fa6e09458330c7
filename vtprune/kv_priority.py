"""PrefixKV's priority: the attention each key receives, summed over query rows, without an ``L x L`` matrix.

PrefixKV (Wang et al., "PrefixKV: Adaptive Prefix KV Cache is What Vision Instruction-Following Models Need for
Efficient Generation", arXiv:2412.03409) ranks a layer's cached keys by the attention the prompt's rows pay them.
Here that sum is computed one block of query rows at a time: a block's scores against the keys its rows can see
(causal: the keys past the block's last position are never multiplied), each row's softmax over them (its
normaliser is its own log-sum-exp), and the rows' weighted column sums. Memory is one ``[heads, rows, visible keys]``
block, bounded by :data:`BLOCK_BYTES` (a block holds fewer rows when the keys are many), never the ``L x L``
matrix; the result equals the softmax-matrix computation (:func:`received_attention_reference`) up to float
rounding. On CUDA with Triton the same sum comes from vtprune's two-pass kernel
(:func:`vtprune.kernels.visual_attention_scores`, a FlashAttention-style (Dao et al., arXiv:2205.14135) first
pass for each row's log-sum-exp and a second for the column sums; its torch twin is the reference).

One function for vtprune's transformers path (:class:`vtprune.methods.prefixkv.PrefixKV`) and the vLLM plugin
(:mod:`vtprune.vllm.layerwise.retention`), so both rank keys alike. At 594 prompt rows, 4 heads of 64 (the serving
proxy's layer) the row blocks take 1.3 ms on two CPU cores, against 4.3 ms for the earlier key-blocked two-pass
loop (docs/serving.md).
"""

from __future__ import annotations

import torch

from vtprune.kernels import visual_attention_scores
from vtprune.kernels._dispatch import resolve_impl

BLOCK = 128  # query rows per block (64-300 rows are within 10 % of each other at 594 rows on a CPU)
BLOCK_BYTES = 64 * 2**20  # a block's float32 scores stay under this size (fewer rows when the keys are many)


def received_attention(query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                       query_valid: torch.Tensor, key_valid: torch.Tensor, scaling: float, block: int = BLOCK,
                       rows_at_positions: bool = False, impl: str = "auto") -> torch.Tensor:
    """``[B, L]`` float32: the head-averaged causal attention each key receives, summed over the valid query rows.

    query ``[B, H, Q, d]`` (post-RoPE) at ``query_positions`` ``[B, Q]`` (row ``q`` sees the keys ``l <=
    query_positions[b, q]`` with ``key_valid[b, l]``), key ``[B, H_kv, L, d]`` (query head ``h`` reads key head
    ``h // (H / H_kv)``), ``query_valid`` ``[B, Q]`` / ``key_valid`` ``[B, L]`` bool. A row that sees no key adds
    nothing. The sum over rows splits over row subsets: a prompt prefilled in chunks sums its chunks' results.
    ``block``: query rows per block (at most). ``rows_at_positions``: the caller knows that row ``q`` sits at
    position ``q`` in every sample (a whole prompt's rows), so the causal spans come from the shapes, with no read
    of the device's values (no host sync). ``impl``: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"``,
    ``"torch"`` (:func:`vtprune.kernels._dispatch.resolve_impl`).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (query rows per block).")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key heads (grouped-query attention).")
    device = query.device
    positions, query_valid = query_positions.to(device=device, dtype=torch.long), query_valid.to(device)
    key_valid = key_valid.to(device)
    if resolve_impl(impl, device) == "triton":
        mean = visual_attention_scores(query, key, positions, key_valid, query_valid, scaling, impl="triton",
                                       check=False)  # averaged over the valid rows: back to their sum
        return mean * query_valid.sum(dim=1, keepdim=True).float()
    return _row_blocks(query, key, positions, query_valid, key_valid, scaling, block, rows_at_positions)


def _row_blocks(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, query_valid: torch.Tensor,
                key_valid: torch.Tensor, scaling: float, block: int, rows_at_positions: bool) -> torch.Tensor:
    """The torch path of :func:`received_attention` (its arguments; ``positions`` long on the query's device)."""
    batch, heads, rows, size = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    total = torch.zeros(batch, length, dtype=torch.float32, device=query.device)
    if rows == 0 or length == 0 or batch == 0:
        return total
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, rows, size)  # head h = kv * G + g
    keys = key.float().transpose(-1, -2)[:, :, None]  # [B, H_kv, 1, d, L]
    weights = query_valid.float() / heads  # [B, Q]: a row's share of the head average
    every_key = not rows_at_positions and bool(key_valid.all())  # only the causal edge needs a mask
    last = None if rows_at_positions else positions.amax(dim=0).cpu()  # [Q] the last key row q sees (one host read)
    first = positions.amin(dim=0).cpu() if every_key else None  # [Q] row q sees every key up to here
    start = 0
    while start < rows:
        end = length if last is None else min(int(last[start:start + block].max()) + 1, length)
        step = max(1, min(block, BLOCK_BYTES // max(batch * heads * end * 4, 1)))
        part = slice(start, min(start + step, rows))
        if last is not None:  # the block may be smaller than its first guess: its own span
            end = min(int(last[part].max()) + 1, length)
        elif rows_at_positions:
            end = min(part.stop, length)
        if end > 0:
            total[:, :end] += _block_sums(grouped[:, :, :, part], keys[..., :end], positions[:, part], key_valid,
                                          weights[:, part], scaling, every_key,
                                          int(first[part].min()) if every_key else 0)
        start = part.stop
    return total


def _block_sums(query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                weights: torch.Tensor, scaling: float, every_key: bool, unmasked: int) -> torch.Tensor:
    """``[B, keys]`` weighted column sums of one row block's softmax; query ``[B, H_kv, G, rows, d]``, keys ``[B,
    H_kv, 1, d, keys]``; the columns before ``unmasked`` are seen by every row (``every_key``: no padding)."""
    scores = torch.matmul(query, keys).mul_(scaling)  # [B, H_kv, G, rows, keys]
    columns = torch.arange(unmasked, keys.shape[-1], device=scores.device)
    if columns.numel():
        hidden = columns[None, None, :] > positions[:, :, None]  # [B, rows, masked columns]
        if not every_key:
            hidden |= ~key_valid[:, None, unmasked:keys.shape[-1]]
        scores[..., unmasked:].masked_fill_(hidden[:, None, None], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    if not every_key:
        probabilities = probabilities.nan_to_num_(0.0)  # a row that sees no key: all -inf, softmax NaN
    per_row = probabilities.sum(dim=(1, 2))  # [B, rows, keys]: summed over the heads
    return torch.bmm(weights[:, None, :], per_row)[:, 0]


def received_attention_reference(query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                                 query_valid: torch.Tensor, key_valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`received_attention` from the whole softmax matrix ``[B, H, Q, L]`` (float64; for tests)."""
    heads, kv_heads, length = query.shape[1], key.shape[1], key.shape[2]
    keys = key.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(query.double(), keys.transpose(-1, -2)) * scaling
    seen = (torch.arange(length)[None, None, :] <= query_positions[:, :, None]) & key_valid[:, None, :]
    probabilities = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return (probabilities.mean(dim=1) * query_valid[:, :, None]).sum(dim=1).float()
