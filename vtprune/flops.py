"""Analytic cost of the language model: prefill, decode-step and ``generate`` FLOPs, and KV-cache bytes.

Per decoder layer over ``n`` tokens (multiply-adds counted as 2 FLOPs; GridProbe's accounting):
``n * [2 (d^2 + 2 d d_kv) + 2 d^2 + 6 d d_ffn] + 4 n^2 d`` (q/k/v, output, gated MLP, scores and
weighted values), plus ``2 n d V`` for the LM head when all logits are computed. The vision tower is not
counted; report it separately when claiming wall-clock savings.

A decode step feeds one new token per sample: per layer the projections and MLP of one token plus
``4 d c`` for attention over the ``c`` keys it sees (the layer's cache and itself), then ``2 d V`` for its
logits. ``generate`` of ``N`` new tokens is one prefill (which yields the first token) and ``N - 1``
decode steps; at step ``t`` (1-based) layer ``l`` attends to ``n_l + t`` keys, ``n_l`` being the tokens
it kept at prefill. Padded batches compute on the padded length, so batch functions take per-layer
lengths that are the maximum over the batch and multiply by the batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LMShape:
    """Sizes of a decoder-only language model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    @classmethod
    def from_config(cls, config) -> LMShape:
        text = getattr(config, "text_config", config)
        return cls(hidden=text.hidden_size, intermediate=text.intermediate_size, layers=text.num_hidden_layers,
                   heads=text.num_attention_heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                   vocab=text.vocab_size)


def layer_flops(shape: LMShape, n: int) -> float:
    """FLOPs of one decoder layer over ``n`` tokens (causal attention counted in full, as GridProbe does)."""
    d, kv, ffn = shape.hidden, shape.kv_dim, shape.intermediate
    return float(n * (2 * (d * d + 2 * d * kv) + 2 * d * d + 6 * d * ffn) + 4 * n * n * d)


def tokens_per_layer(shape: LMShape, text_tokens: int, visual_tokens: int,
                     stages: Sequence[tuple[int, int]]) -> list[int]:
    """Tokens each layer sees: ``stages`` is ``[(layer, visual tokens kept from that layer on), ...]``."""
    counts, kept = [], visual_tokens
    stage_at = dict(stages)
    for layer in range(shape.layers):
        kept = stage_at.get(layer, kept)
        counts.append(text_tokens + kept)
    return counts


def prefill_flops(shape: LMShape, per_layer: Sequence[int], lm_head_tokens: int = 1, batch: int = 1) -> float:
    """Prefill FLOPs of the LM for per-layer token counts, with logits for ``lm_head_tokens`` positions.

    ``batch`` samples of the same (padded) per-layer lengths multiply the whole count.
    """
    single = sum(layer_flops(shape, n) for n in per_layer) + 2.0 * lm_head_tokens * shape.hidden * shape.vocab
    return batch * single


def decode_step_flops(shape: LMShape, keys_per_layer: Sequence[int], batch: int = 1) -> float:
    """FLOPs of one decode step: one new token per sample attending to ``keys_per_layer[l]`` keys at layer ``l``.

    ``keys_per_layer`` counts the keys the new token sees, itself included (cached tokens + 1).
    """
    d, kv, ffn = shape.hidden, shape.kv_dim, shape.intermediate
    token = 2 * (d * d + 2 * d * kv) + 2 * d * d + 6 * d * ffn
    single = sum(token + 4 * c * d for c in keys_per_layer) + 2.0 * d * shape.vocab
    return float(batch * single)


def decode_flops(shape: LMShape, per_layer: Sequence[int], new_tokens: int, batch: int = 1) -> float:
    """FLOPs of the ``new_tokens - 1`` decode steps of ``generate`` after a prefill that left ``per_layer``."""
    return sum(decode_step_flops(shape, [n + step for n in per_layer], batch) for step in range(1, new_tokens))


def generate_flops(shape: LMShape, per_layer: Sequence[int], new_tokens: int, batch: int = 1) -> float:
    """FLOPs of ``generate(max_new_tokens=new_tokens)``: a prefill (logits of the last position) + decode steps."""
    return prefill_flops(shape, per_layer, 1, batch) + decode_flops(shape, per_layer, new_tokens, batch)


def kv_cache_bytes(shape: LMShape, per_layer: Sequence[int], bytes_per_value: int = 2, batch: int = 1) -> int:
    """Bytes of keys and values held for per-layer cache lengths (``batch`` samples of those lengths).

    After a prefill the lengths are the prefill's per-layer token counts; after ``generate`` of ``N`` new
    tokens each layer also holds the first ``N - 1`` generated tokens (the last one is never fed back).
    """
    return int(batch * sum(2 * n * shape.kv_dim * bytes_per_value for n in per_layer))
