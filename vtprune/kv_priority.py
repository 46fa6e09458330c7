"""PrefixKV's priority: the attention each key receives, summed over query rows, without an ``L x L`` matrix.

PrefixKV (Wang et al., "PrefixKV: Adaptive Prefix KV Cache is What Vision Instruction-Following Models Need for
Efficient Generation", arXiv:2412.03409) ranks a layer's cached keys by the attention the prompt's rows pay them.
Here that sum is computed block by block, as FlashAttention (Dao et al., NeurIPS 2022, arXiv:2205.14135) computes
attention: for each block of query rows, a first pass over the key blocks a row can see gives each row's softmax
normaliser (its log-sum-exp), a second pass adds ``exp(s - lse)`` of every (row, key) pair to the keys' column
sums. Memory is one ``[heads, rows, keys]`` block, key blocks above a row block's last position are skipped
(causal), and the result equals the softmax-matrix computation (:func:`received_attention_reference`) up to
float rounding. One function for vtprune's transformers path (:class:`vtprune.methods.prefixkv.PrefixKV`) and the
vLLM plugin (:mod:`vtprune.vllm.layerwise.retention`), so both rank keys alike.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128  # rows and keys per block (the fastest of 64 / 128 / 256 at 594 rows on a CPU: docs/serving.md)
KEEP_BYTES = 64 * 2**20  # a row block's scores up to this size are kept for the second pass, not recomputed


def received_attention(query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                       query_valid: torch.Tensor, key_valid: torch.Tensor, scaling: float, block: int = BLOCK,
                       rows_at_positions: bool = False) -> torch.Tensor:
    """``[B, L]`` float32: the head-averaged causal attention each key receives, summed over the valid query rows.

    query ``[B, H, Q, d]`` (post-RoPE) at ``query_positions`` ``[B, Q]`` (row ``q`` sees the keys ``l <=
    query_positions[b, q]`` with ``key_valid[b, l]``), key ``[B, H_kv, L, d]`` (query head ``h`` reads key head
    ``h // (H / H_kv)``), ``query_valid`` ``[B, Q]`` / ``key_valid`` ``[B, L]`` bool. A row that sees no key adds
    nothing. The sum over rows splits over row subsets: a prompt prefilled in chunks sums its chunks' results.
    ``rows_at_positions``: the caller knows that row ``q`` sits at position ``q`` in every sample (a whole prompt's
    rows), so the causal spans come from the shapes, with no read of the device's values (no host sync).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive int (rows and keys per block).")
    batch, heads, rows, size = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key heads (grouped-query attention).")
    device = query.device
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, rows, size)  # head h = kv * G + g
    keys = key.float()
    positions = query_positions.to(device=device, dtype=torch.long)
    weights = query_valid.to(device).float() / heads  # [B, Q]: a row's share of the head average
    key_valid = key_valid.to(device)
    every_key = not rows_at_positions and bool(key_valid.all())  # masks every block when the positions are known
    last = None if rows_at_positions else positions.amax(dim=0).cpu()  # [Q] the last key row q sees (one host read)
    total = torch.zeros(batch, length, dtype=torch.float32, device=device)
    for start in range(0, rows, block):
        part = slice(start, start + block)
        end = min(min(start + block, rows) if last is None else int(last[part].max()) + 1, length)
        spans = [(k, min(k + block, end)) for k in range(0, end, block)]
        first_row = start if last is None else int(positions[:, part].amin().cpu())
        scores = _ScoreBlocks(grouped[:, :, :, part], keys, positions[:, part], key_valid, every_key, scaling,
                              first_row)
        kept = math.prod(scores.shape) * end * 4 <= KEEP_BYTES  # this row block's scores fit: the second pass reuses them
        lse, held = torch.full(scores.shape, float("-inf"), device=device), []
        for first, stop in spans:
            block_scores = scores(first, stop)
            lse = torch.logaddexp(lse, torch.logsumexp(block_scores, dim=-1))
            held.append(block_scores if kept else None)
        lse = torch.where(torch.isinf(lse), torch.inf, lse)  # a row that sees no key: exp(s - inf) = 0
        for (first, stop), block_scores in zip(spans, held, strict=True):
            block_scores = scores(first, stop) if block_scores is None else block_scores
            received = block_scores.sub_(lse[..., None]).exp_()  # [B, H_kv, G, rows, keys]
            total[:, first:stop] += torch.einsum("bhgqk,bq->bk", received, weights[:, part])
    return total


class _ScoreBlocks:
    """Masked, scaled scores ``[B, H_kv, G, rows, keys]`` of one row block against key blocks."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                 every_key: bool, scaling: float, first_row: int) -> None:
        self.query, self.key, self.positions, self.key_valid = query, key, positions, key_valid
        self.every_key, self.scaling = every_key, scaling
        self.first_row = first_row  # the block's first position: rows see at least the keys up to it
        self.shape = query.shape[:-1]

    def __call__(self, first: int, stop: int) -> torch.Tensor:
        scores = torch.matmul(self.query, self.key[:, :, None, first:stop].transpose(-1, -2)) * self.scaling
        if stop - 1 <= self.first_row and self.every_key:
            return scores  # every row of the block sees every key of the span
        columns = torch.arange(first, stop, device=scores.device)
        seen = columns[None, None, :] <= self.positions[:, :, None]  # [B, rows, keys]
        seen = seen & self.key_valid[:, None, first:stop]
        return scores.masked_fill(~seen[:, None, None], float("-inf"))


def received_attention_reference(query: torch.Tensor, key: torch.Tensor, query_positions: torch.Tensor,
                                 query_valid: torch.Tensor, key_valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`received_attention` from the whole softmax matrix ``[B, H, Q, L]`` (float64; for tests)."""
    heads, kv_heads, length = query.shape[1], key.shape[1], key.shape[2]
    keys = key.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(query.double(), keys.transpose(-1, -2)) * scaling
    seen = (torch.arange(length)[None, None, :] <= query_positions[:, :, None]) & key_valid[:, None, :]
    probabilities = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return (probabilities.mean(dim=1) * query_valid[:, :, None]).sum(dim=1).float()
