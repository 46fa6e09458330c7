"""KV memory of one served request, as vLLM with vtprune's plugin allocates it: per layer, the tokens it holds
rounded up to whole blocks.

Unpruned and pre-LLM methods: every layer holds the prompt (the kept placeholders for a pre-LLM method) and the
output. A layer-wise method: a layer in region ``s`` holds ``tokens - pruned[s]``
(:meth:`vtprune.vllm.layerwise.plan.LayerPlan.pruned_counts`, the counts the plugin's KV managers allocate by).
KV retention (``prefixkv``): each layer is a KV cache group of its own; the prefill is allocated whole (the counts are
known when it ends), then every layer frees the blocks past its kept entries. The formula counts the layers alike:
each holds the text, ``keep`` of the visual tokens (their mean over the layers) and the output; the engine's own
per-layer counts differ (``kv_blocks_engine``), and the prefill's transient peak is the whole prompt.
"""

from __future__ import annotations

import math

from vtprune.config import keep_count
from vtprune.vllm.settings import is_layer_wise, is_retention


def layer_tokens(method: str, keep: float, num_layers: int, visual: int, tokens: int) -> list[int]:
    """Tokens each decoder layer holds for a request of ``tokens`` prompt + output tokens with ``visual`` visual
    tokens in its prompt (``method`` ``"none"`` or a pre-LLM method: the prompt as it entered the model)."""
    if is_retention(method):
        return [tokens - (visual - keep_count(keep, visual))] * num_layers
    if method == "none" or not is_layer_wise(method):
        return [tokens] * num_layers
    from vtprune.vllm.layerwise.plan import make_layer_plan

    plan = make_layer_plan(method, keep, num_layers)
    pruned = plan.pruned_counts(visual, keep)
    return [tokens - pruned[plan.region_of_layer(layer)] for layer in range(num_layers)]


def value_bytes(dtype: str) -> int:
    """Bytes of one KV value in ``dtype`` (``float32`` 4; ``float16`` / ``bfloat16`` 2)."""
    return 4 if dtype == "float32" else 2


def kv_fields(method: str, keep: float, text_config: dict, visual: int, tokens: float, block_size: int,
              budget_gib: float, bytes_per_value: int = 4) -> dict:
    """``kv_tokens_per_req`` (allocated, mean over layers), ``kv_read_tokens_per_req`` (what a decode step reads,
    mean over layers), ``kv_blocks_per_req`` (blocks of ``block_size`` tokens summed over
    layers, divided by the layer count: the blocks of an unpruned request), ``kv_mib_per_req`` and
    ``max_requests_in_budget`` (requests whose KV fits ``budget_gib``)."""
    layers = int(text_config["num_hidden_layers"])
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    per_token_layer = 2 * int(text_config["num_key_value_heads"]) * head_dim * bytes_per_value
    held = layer_tokens(method, keep, layers, visual, round(tokens))
    read = sum(held) / layers
    blocks = [math.ceil(count / block_size) for count in held]
    mib = sum(blocks) * block_size * per_token_layer / 2**20
    return {"kv_tokens_per_req": round(sum(held) / layers, 1), "kv_read_tokens_per_req": round(read, 1),
            "kv_blocks_per_req": round(sum(blocks) / layers, 2),
            "kv_mib_per_req": round(mib, 3), "max_requests_in_budget": int(budget_gib * 1024 // mib)}
