"""Decode steps (and follow-up turns) on a pruned cache: masks and positions for the shorter per-layer caches.

Nothing here reads a device value back: which regions have padding is known from the prefill (host flags),
masks are built once per step and region and shared by the region's layers, and no scoring runs.
"""

from __future__ import annotations

from typing import Any

import torch

from vtprune.adapters.base import Adapter
from vtprune.layout import attention_mask_for, mask_style
from vtprune.plan import Wiring
from vtprune.state import CallState


def lm_kwargs(call: CallState, kwargs: dict) -> dict:
    """Language-model pre-hook while decoding: record the new key columns; map the 2-D mask after a pre-LLM stage.

    The caller's 2-D mask covers ``prompt_length + decoded + new`` columns; its columns after the prompt are
    those of the tokens decoded so far (and of this step). After a pre-LLM stage every layer caches the
    pruned prompt, so the mask's prompt part is replaced by the pruned layout's validity.
    """
    mask = kwargs.get("attention_mask")
    has_mask = isinstance(mask, torch.Tensor) and mask.dim() == 2
    if has_mask:
        call.decode_columns = mask[:, call.prompt_length:].bool()
    if call.pre_llm_valid is None:
        return kwargs
    step = kwargs.get("inputs_embeds")
    step = step if step is not None else kwargs["input_ids"]
    batch, new_tokens = step.shape[:2]
    if has_mask:
        kwargs["attention_mask"] = torch.cat([call.pre_llm_valid.long(), mask[:, call.prompt_length:].long()], 1)
    elif call.pre_llm_padded:
        ones = torch.ones(batch, call.decoded + new_tokens, dtype=torch.long, device=call.pre_llm_valid.device)
        kwargs["attention_mask"] = torch.cat([call.pre_llm_valid.long(), ones], 1)
    positions = kwargs.get("position_ids")
    if call.pre_llm_removed is not None:  # compact: the kept prompt's length, then the tokens decoded so far
        if positions is None:
            start = call.pre_llm_valid.sum(dim=1, keepdim=True) + call.decoded
            kwargs["position_ids"] = start + torch.arange(new_tokens, device=start.device)
        else:
            kwargs["position_ids"] = positions - call.pre_llm_removed.to(positions.device)[:, None]
    elif positions is None:
        start = call.prompt_length + call.decoded
        kwargs["position_ids"] = torch.arange(start, start + new_tokens, device=step.device).expand(batch, -1)
    return kwargs


def layer_kwargs(wiring: Wiring, call: CallState, index: int, args: tuple, kwargs: dict
                 ) -> tuple[tuple, dict] | None:
    """Decoder-layer pre-hook while decoding: the mask (and compact positions) of the layer's stage region."""
    region = wiring.region_of_layer[index]
    if region == 0 or region > len(call.regions):
        return None
    update = call.step.get(region)
    if update is None:
        hidden = args[0] if args else kwargs["hidden_states"]
        update = _region_update(wiring.adapter, call, region, hidden.shape[1], kwargs)
        call.step[region] = update
    kwargs.update(update)
    return args, kwargs


def _region_update(adapter: Adapter, call: CallState, region: int, new_tokens: int, kwargs: dict
                   ) -> dict[str, Any]:
    """Keyword arguments every layer of ``region`` gets in this step (built once per step and region)."""
    entry = call.regions[region - 1]
    incoming = kwargs.get("attention_mask")
    update: dict[str, Any] = {}
    if incoming is None and not entry.padded:
        update["attention_mask"] = None  # no padding anywhere: every cached key is attended
    else:
        columns = call.decode_columns
        if columns is None:
            columns = torch.ones(entry.valid.shape[0], call.decoded + new_tokens, dtype=torch.bool,
                                 device=entry.valid.device)
        kv_valid = torch.cat([entry.valid, columns.to(entry.valid.device)], dim=1)
        style = mask_style(incoming, adapter.attn_implementation)
        dtype = incoming.dtype if isinstance(incoming, torch.Tensor) else torch.float32
        update["attention_mask"] = attention_mask_for(kv_valid, new_tokens, style, dtype)
    embeddings = kwargs.get("position_embeddings")
    if entry.removed is not None and embeddings is not None:
        positions = kwargs.get("position_ids")
        compact = positions - entry.removed.to(positions.device)
        update["position_embeddings"] = adapter.language_model.rotary_emb(embeddings[0], compact)
        update["position_ids"] = compact
    return update


def unseen_tokens(call: CallState, kwargs: dict, total: int | None = None) -> dict | None:
    """The forward's inputs cut to the tokens its cache has not seen, when ``generate()`` got them wrong.

    ``generate()`` continuing from a cache (a follow-up turn) feeds the tokens beyond the cache's layer-0
    length. After a pre-LLM stage or KV retention layer 0 holds fewer entries than the tokens it has seen, so
    it feeds some seen tokens again. The call knows how many tokens (columns) it has consumed
    (``prompt_length + decoded``); the conversation's length is the 2-D mask's width, else ``total``: the
    length of the ``input_ids`` the ``generate()`` call was given (recorded by
    :class:`vtprune.guards.GenerateGuard`, since ``generate()`` drops an all-ones mask). Without either, every
    token of the forward is new. Returns None when nothing needs cutting.
    """
    mask, ids = kwargs.get("attention_mask"), kwargs.get("input_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        total = mask.shape[1]
    if call.pre_llm_valid is None or ids is None or total is None:
        return None
    given, new = ids.shape[1], total - call.prompt_length - call.decoded
    if new <= 0 or given <= new:
        return None
    fixed = dict(kwargs)
    for key in ("input_ids", "mm_token_type_ids", "token_type_ids", "position_ids"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] == given:
            fixed[key] = value[..., given - new:]
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.shape[1] == given:
        fixed["inputs_embeds"] = embeds[:, given - new:]
    return fixed
