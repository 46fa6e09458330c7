"""KV-cache retention (PrefixKV): after a prefill, each layer's cache keeps its own top-priority tokens.

The hidden states of the prefill kept every token; the scorer gave every layer a priority ``[B, L]`` of its
keys (``call.method_state["kv_priority"]``). Here the per-layer counts are decided (a profile's ratios, or the
per-sample search of :func:`vtprune.methods.prefixkv.layer_budgets`), each layer's keys and values are
gathered to the kept entries (original RoPE positions are already in the keys), re-padded on the input's
padding side, and every layer gets its own decode region (its kept slots), so decoding masks each layer's
shorter cache exactly as the in-LM stages do.
"""

from __future__ import annotations

from typing import Any

import torch

from vtprune.layout import repad_known, select_kept
from vtprune.methods.prefixkv import counts_from_ratios, layer_budgets, release_kept
from vtprune.plan import KVPlan, Wiring
from vtprune.state import CallState, DecodeRegion


def evictable_mask(view: Any, scope: str, start: int) -> torch.Tensor:
    """``[B, L]`` slots that may leave a layer's cache: visual tokens, or the prompt but its first ``start`` and
    its last token (``scope="prompt"``)."""
    if scope == "visual":
        return view.visual & view.valid
    rank = view.valid.long().cumsum(dim=1)
    last = rank == view.valid.sum(dim=1, keepdim=True)
    return view.valid & (rank > start) & ~last


def layer_counts(kv: KVPlan, priorities: torch.Tensor, evictable: torch.Tensor, valid: torch.Tensor
                 ) -> tuple[list[list[int]], list[int], list[int]]:
    """``[layer][sample]`` evictable tokens each layer keeps, ``[sample]`` prompt tokens always kept and
    ``[sample]`` evictable tokens.

    One host transfer: the priorities ``[layers, B, L]`` and both masks travel together (the budget search of
    :func:`layer_budgets` reads values in a loop, so it runs on the host copy).
    """
    layers = priorities.shape[0]
    search = kv.ratios is None and kv.keep < 1.0
    rows = [evictable.float(), valid.float()] + ([priorities.float().reshape(-1, priorities.shape[-1])]
                                                 if search else [])
    host = torch.cat(rows).numpy(force=True)
    batch = evictable.shape[0]
    mask, fixed = host[:batch] > 0, (host[batch:2 * batch] > 0) & ~(host[:batch] > 0)
    counts, text = mask.sum(axis=1).tolist(), fixed.sum(axis=1).tolist()
    if kv.retention.counting == "release":  # parity="release": the release's counts
        per_sample = _release_counts(kv, host, counts, layers, search)
    elif kv.ratios is not None:
        per_sample = [counts_from_ratios(kv.ratios, n) for n in counts]
    elif not search:
        per_sample = [[n] * layers for n in counts]
    else:
        scores = host[2 * batch:].reshape(layers, batch, -1)
        per_sample = [layer_budgets(scores[:, b][:, mask[b]], kv.keep) for b in range(batch)]
    return [[per_sample[b][layer] for b in range(batch)] for layer in range(layers)], text, counts


def _release_counts(kv: KVPlan, host: Any, counts: list[int], layers: int, search: bool) -> list[list[int]]:
    """Per sample, the release's per-layer counts (:func:`release_kept`) over its whole unpadded prompt; host:
    the rows of :func:`layer_counts` (evictable ``[B, L]``, valid ``[B, L]``, then the priorities if searched)."""
    batch = len(counts)
    valid = host[batch:2 * batch] > 0
    if not search and kv.ratios is None:
        return [[n] * layers for n in counts]  # keep = 1: nothing is evicted
    scores = host[2 * batch:].reshape(layers, batch, -1) if search else None
    return [release_kept(int(valid[b].sum()), n, kv.keep, ratios=kv.ratios,
                         priority=None if scores is None else scores[:, b][:, valid[b]]) for b, n in enumerate(counts)]


def evict(wiring: Wiring, call: CallState, cache: Any) -> None:
    """Shrink every layer of ``cache`` to its kept entries and set the call's per-layer decode regions."""
    view, kv = call.views[0], wiring.plan.kv
    priorities = torch.stack([call.method_state["kv_priority"][i] for i in range(wiring.adapter.num_layers)])
    evictable = evictable_mask(view, kv.retention.scope, kv.retention.start)
    counts, text, evictable_counts = layer_counts(kv, priorities, evictable, view.valid)
    width = max(evictable_counts, default=0)
    device_counts = torch.tensor(counts, device=evictable.device)  # [layers, B]
    regions, ordinals, visual_kept = [], [], []
    for index, layer in enumerate(cache.layers):
        kept = select_kept(priorities[index].to(evictable.device), evictable, view.valid, device_counts[index],
                           width=width, k_max=max(counts[index], default=0))
        lengths = [t + n for t, n in zip(text, counts[index], strict=True)]
        layout = repad_known(kept, call.left_padding, lengths)
        gather = layout.index.to(layer.keys.device)[:, None, :, None]
        layer.keys = torch.gather(layer.keys, 2, gather.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = torch.gather(layer.values, 2, gather.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        padded = min(lengths, default=0) != layout.index.shape[1]
        regions.append(DecodeRegion(valid=layout.valid, padded=padded))
        ordinals.append(torch.where(layout.valid, torch.gather(view.ordinal, 1, layout.index), -1))
        if kv.retention.scope != "visual":
            visual_kept.append((kept & view.visual).sum(dim=1))
    call.stats.stage_layers, call.stats.retained_kv = list(range(len(regions))), True
    call.cache_pruned = any(n < total for row in counts for n, total in zip(row, evictable_counts, strict=True))
    # visual tokens in each layer's cache, per sample (known on the host when only visual tokens are evictable)
    call.stats.kept = counts if kv.retention.scope == "visual" else torch.stack(visual_kept).tolist()
    call.stage_ordinals = ordinals
    call.regions = regions
    call.pre_llm_valid, call.pre_llm_padded = regions[0].valid, True  # layer 0 sizes transformers' masks
    if kv.ratios is not None and kv.retention.decode == "release":
        call.kv_decode = release_state(kv, view, counts, text, regions)


def release_state(kv: KVPlan, view: Any, counts: list[list[int]], text: list[int],
                  regions: list[DecodeRegion]) -> dict:
    """Per layer: where the next decode-time eviction lands (``distance`` before the end of the compressed
    prompt, then the entries after it), the tokens each sample has seen and its cache length."""
    seen = view.valid.sum(dim=1)
    pointers, kept = [], []
    for index, region in enumerate(regions):
        width = region.valid.shape[1]
        slots = torch.arange(width, device=region.valid.device).expand_as(region.valid)
        end = torch.where(region.valid, slots + 1, 0).max(dim=1).values  # one past the last kept slot
        pointers.append((end + kv.retention.distance).clamp(min=0))
        kept.append(torch.tensor([t + n for t, n in zip(text, counts[index], strict=True)], device=seen.device))
    return {"seen": seen, "pointers": pointers, "kept": kept, "evicted": [torch.zeros_like(seen) for _ in regions]}


def release_step(kv: KVPlan, call: CallState) -> None:
    """After a decode step: mask, per layer, the entry the release policy evicts when the cache holds more than
    ``(1 - ratio_l)`` of the tokens seen (no device sync; at most one entry per layer and step)."""
    state = call.kv_decode
    seen = state["seen"] + call.decoded
    for index, (ratio, region) in enumerate(zip(kv.ratios, call.regions, strict=True)):
        allowed = torch.ceil((1.0 - ratio) * seen.double()).long()
        over = state["kept"][index] + call.decoded - state["evicted"][index] > allowed
        pointer = state["pointers"][index].clamp(max=region.valid.shape[1] - 1)
        current = region.valid.gather(1, pointer[:, None])
        region.valid.scatter_(1, pointer[:, None], current & ~over[:, None])
        state["evicted"][index] = state["evicted"][index] + over.long()
        state["pointers"][index] = state["pointers"][index] + over.long()
        region.padded = True
