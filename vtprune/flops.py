"""Analytic prefill cost of the language model: FLOPs and KV-cache bytes for a per-layer token count.

Per decoder layer over ``n`` tokens (multiply-adds counted as 2 FLOPs; GridProbe's accounting):
``n * [2 (d^2 + 2 d d_kv) + 2 d^2 + 6 d d_ffn] + 4 n^2 d`` (q/k/v, output, gated MLP, scores and
weighted values), plus ``2 n d V`` for the LM head when all logits are computed. The vision tower is not
counted; report it separately when claiming wall-clock savings.
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


def prefill_flops(shape: LMShape, per_layer: Sequence[int], lm_head_tokens: int = 1) -> float:
    """Prefill FLOPs of the LM for per-layer token counts, with logits for ``lm_head_tokens`` positions."""
    return sum(layer_flops(shape, n) for n in per_layer) + 2.0 * lm_head_tokens * shape.hidden * shape.vocab


def kv_cache_bytes(shape: LMShape, per_layer: Sequence[int], bytes_per_value: int = 2) -> int:
    """Bytes of keys and values the prefill leaves in the cache (batch 1)."""
    return int(sum(2 * n * shape.kv_dim * bytes_per_value for n in per_layer))
