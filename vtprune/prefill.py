"""Prefill: score, select and slice the visual tokens (the pre-LLM stage and the in-LM stages).

Lengths after each stage are known on the host (``text + keep_count`` per sample), so a stage reads nothing
back from the device unless the method changes the keep mask itself (VFlowOpt's recycling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vtprune.errors import UserError
from vtprune.guards import unsupported_cache_message
from vtprune.layout import Layout, attention_mask_for, gather_tokens, mask_style, repad_known, select_kept
from vtprune.methods.base import Scorer, merge_step
from vtprune.plan import Plan, Wiring, group_sizes
from vtprune.scoring import ScoreContext
from vtprune.state import CallState, StageRecord, StageView


def lm_input(wiring: Wiring, call: CallState, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Language-model pre-hook at prefill: read the padding, build the first view, run a pre-LLM stage."""
    embeds = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        raise RuntimeError(
            "vtprune needs the 2-D attention mask and a DynamicCache; this call passed a prepared 4-D mask "
            "(static or compiled cache). Use the default cache (generate(..., cache_implementation=None))."
        )
    if embeds is None:
        call.abandoned = True
        return None
    batch, length = embeds.shape[:2]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        valid = mask.bool()
    else:
        valid = torch.ones(batch, length, dtype=torch.bool, device=embeds.device)
    # The prefill's one read from the device: lengths, padding side and visual counts of every sample.
    summary = torch.stack([valid.sum(dim=1), valid[:, 0].long(), valid[:, -1].long(), call.num_visual.long()])
    lengths, first, last, counts = summary.tolist()
    if not any(counts):  # no visual token: this forward runs unpruned
        call.abandoned = True
        return None
    if call.cache_problem is not None:
        raise UserError(unsupported_cache_message(call.cache_problem))
    plan_counts(wiring.plan, call, counts)
    call.left_padding = not all(first) or all(last)
    call.text_counts = [n - v for n, v in zip(lengths, call.visual_counts, strict=True)]
    view = StageView(
        index=torch.arange(length, device=embeds.device).expand(batch, length),
        valid=valid, visual=call.visual & valid, ordinal=call.ordinal,
        lengths=lengths, alive=list(call.visual_counts), alive_count=call.num_visual,
    )
    stages = wiring.stages
    if stages and stages[0].layer == 0:
        kwargs, view = _pre_llm_stage(wiring, call, kwargs, view)
    call.views = [view]
    call.base_count = view.valid.sum(dim=1)
    call.next_stage = 1 if stages and stages[0].layer == 0 else 0
    return args, kwargs


def plan_counts(plan: Plan, call: CallState, counts: list[int]) -> None:
    """The call's visual counts (host) and every stage's kept counts, on the host and on the device (computed
    there with the same rounding, so no host-to-device copy; under ``rounding="per_image"`` the sum of each image's
    and frame's count, copied there)."""
    call.visual_counts, call.stats.visual_tokens = counts, counts
    groups = None
    if plan.rounding == "per_image":
        groups = [group_sizes(call.segments[row], n) for row, n in enumerate(counts)]
    call.planned = plan.kept_counts(counts, groups) or [counts]
    call.stage_counts = plan.device_kept_counts(call.num_visual, call.planned)


def _pre_llm_stage(wiring: Wiring, call: CallState, kwargs: dict, view: StageView) -> tuple[dict, StageView]:
    embeds = kwargs["inputs_embeds"]
    ctx = context(wiring, call, view, embeds, -1, None, None, 0)
    keep, embeds, new = select(wiring, call, ctx, view, embeds)
    kwargs = dict(kwargs)
    kwargs["inputs_embeds"] = gather_tokens(embeds, new.index_in_previous, 1)
    kwargs["attention_mask"] = new.valid.long()
    if wiring.plan.positions == "compact":  # kept tokens and the text after them numbered 0, 1, 2, ...
        kwargs["position_ids"] = compact_positions(new.valid)
        call.pre_llm_removed = view.valid.sum(dim=1) - new.valid.sum(dim=1)
    else:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(embeds.shape[1], device=embeds.device).expand(embeds.shape[0], -1)
        kwargs["position_ids"] = gather_tokens(positions, new.index_in_previous, positions.dim() - 1)
    kwargs = wiring.adapter.prune_lm_inputs(kwargs, new.index_in_previous, new.valid)
    call.pre_llm_index, call.pre_llm_valid, call.pre_llm_padded = new.index, new.valid, new.padded
    width = new.index.shape[1]
    identity = torch.arange(width, device=embeds.device).expand(embeds.shape[0], width)
    return kwargs, StageView(index=identity, valid=new.valid, visual=new.visual, ordinal=new.ordinal,
                             lengths=new.lengths, alive=new.alive, alive_count=new.alive_count)


def layer(wiring: Wiring, call: CallState, index: int, module: nn.Module, args: tuple, kwargs: dict):
    """Decoder-layer pre-hook at prefill: score at scoring layers, drop at stage layers, slice the arguments."""
    hidden = args[0] if args else kwargs["hidden_states"]
    original = kwargs
    kwargs = apply_view(wiring, call, original)
    stages, scorer = wiring.stages, wiring.scorer
    while call.next_stage < len(stages):
        stage = stages[call.next_stage]
        ctx = context(wiring, call, call.view, hidden, index, module, kwargs.get("position_embeddings"),
                      call.next_stage)
        if scorer.score_layer(stage) == index and call.pending_scores is None:
            call.pending_scores = scorer.score(ctx)
        if stage.layer != index:
            break
        _, hidden, new = select(wiring, call, ctx, call.view, hidden)
        hidden = gather_tokens(hidden, new.index_in_previous, 1)
        call.views.append(new)
        call.next_stage += 1
        kwargs = apply_view(wiring, call, original)
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def apply_view(wiring: Wiring, call: CallState, kwargs: dict) -> dict:
    """Replace mask, ``(cos, sin)`` and position ids by those of the current view (built once per view)."""
    view = call.view
    if view.kwargs.get("source") is not None:
        return {**kwargs, **{k: v for k, v in view.kwargs.items() if k != "source"}}
    if len(call.views) == 1:
        view.kwargs["source"] = "identity"
        return kwargs
    update: dict[str, Any] = {"source": "view"}
    incoming = kwargs.get("attention_mask")
    style = mask_style(incoming, wiring.adapter.attn_implementation)
    length = view.index.shape[1]
    if incoming is not None or view.padded:
        dtype = incoming.dtype if isinstance(incoming, torch.Tensor) else torch.float32
        update["attention_mask"] = attention_mask_for(view.valid, length, style, dtype)
    else:
        update["attention_mask"] = None
    embeddings = kwargs.get("position_embeddings")
    if embeddings is not None:
        update["position_embeddings"] = tuple(gather_tokens(t, view.index, 1) for t in embeddings)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        update["position_ids"] = gather_tokens(positions, view.index, positions.dim() - 1)
    if wiring.plan.positions == "compact" and embeddings is not None:
        compact = compact_positions(view.valid)
        cos, sin = wiring.adapter.language_model.rotary_emb(embeddings[0], compact.to(embeddings[0].device))
        update.update({"position_embeddings": (cos, sin), "position_ids": compact})
    view.kwargs = update
    return {**kwargs, **{k: v for k, v in update.items() if k != "source"}}


def context(wiring: Wiring, call: CallState, view: StageView, hidden: torch.Tensor, index: int,
            layer_module: nn.Module | None, embeddings: Any, stage_index: int) -> ScoreContext:
    return ScoreContext(
        hidden=hidden, layer_index=index, layer=layer_module, position_embeddings=embeddings,
        valid=view.valid, visual=view.visual, ordinal=view.ordinal, num_visual=call.num_visual,
        segments=call.segments, adapter=wiring.adapter, inputs=call.inputs, state=call.method_state,
        visual_counts=call.visual_counts, stage=wiring.stages[stage_index], stage_index=stage_index,
        count_rule=wiring.plan.count, planned=call.planned[stage_index] if wiring.stages else None,
        rounding=wiring.plan.rounding,
    )


def select(wiring: Wiring, call: CallState, ctx: ScoreContext, view: StageView, hidden: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, StageView]:
    """Keep mask ``[B, L]``, hidden states (merged if the scorer merges) and the next view of one stage."""
    scores = _stage_scores(wiring.scorer, call, ctx, view)
    counts = [min(n, alive) for n, alive in zip(call.planned[ctx.stage_index], view.alive, strict=True)]
    counts_t = torch.minimum(call.stage_counts[ctx.stage_index].to(view.valid.device), view.alive_count)
    selected = select_with_query(scores.to(view.valid.device), view.visual, view.valid, counts_t,
                                 width=max(view.alive, default=0), k_max=max(counts, default=0))
    kept, hidden, merged = _merge(wiring, ctx, selected, scores, hidden, view)
    if kept is not selected:  # a merge step that demoted the query token gets it back (on top of its count)
        kept = kept | (query_slots(view.valid) & view.visual)
    alive, lengths, counts_t = _kept_lengths(call, view, kept, counts, counts_t, changed=kept is not selected)
    new = next_view(view, repad_known(kept, call.left_padding, lengths), lengths, alive, counts_t)
    _record(wiring, call, ctx, view, scores, kept, alive, merged, new)
    return kept, hidden, new


def query_slots(valid: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: each sample's last valid slot (of ``valid`` ``[B, L]``, left or right padded), its query
    token: the last prompt token, whose row gives the next-token logit."""
    seen = valid.long().cumsum(dim=1)
    return valid & (seen == seen[:, -1:])


def select_with_query(scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
                      width: int | None = None, k_max: int | None = None) -> torch.Tensor:
    """:func:`vtprune.layout.select_kept` that never prunes a sample's query token (its last valid slot).

    A prompt that ends on a visual token (an image-only caption prompt such as ``"USER: <image>"``) would otherwise
    lose the row its next token is read from. The query counts inside the sample's budget: a visual query is kept
    and the top ``counts[b] - 1`` of the other alive visual slots join it, so kept lengths stay the plan's.
    scores ``[B, L]``, visual / valid ``[B, L]`` bool, counts ``[B]`` long (at least 1 where a sample has visual
    tokens); returns the kept mask ``[B, L]``. The one place both the transformers engine and the vLLM plugin
    select through.
    """
    query = query_slots(valid) & visual
    others = (counts.to(valid.device) - query.sum(dim=1)).clamp(min=0)
    return select_kept(scores, visual & ~query, valid, others, width=width, k_max=k_max)


def _stage_scores(scorer: Scorer, call: CallState, ctx: ScoreContext, view: StageView) -> torch.Tensor:
    """``[B, L]`` scores of the stage: those taken at its scoring layer, else scored now on ``ctx``."""
    scores = call.pending_scores
    if scores is None or scores.shape != view.valid.shape:
        scores = scorer.score(ctx)
    call.pending_scores = None
    return scores


def _merge(wiring: Wiring, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor,
           view: StageView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The scorer's merge step after selection, if it has one: ``(kept, hidden, merged)``; ``merged`` ``[B, L]``
    marks the kept visual slots it rewrote (for observers; None without observers or merge step). A merge step
    that keeps the selection returns the same mask object."""
    merge = merge_step(wiring.scorer)
    if merge is None:
        return kept, hidden, None
    before = hidden.clone() if wiring.observers else None
    kept, hidden = merge(ctx, kept, scores, hidden)
    merged = None
    if before is not None and before.shape == hidden.shape:
        merged = (hidden != before).any(dim=-1) & kept & view.visual
    return kept, hidden, merged


def _kept_lengths(call: CallState, view: StageView, kept: torch.Tensor, counts: list[int], counts_t: torch.Tensor,
                  changed: bool) -> tuple[list[int], list[int], torch.Tensor]:
    """Visual tokens alive per sample (host), kept lengths (host) and alive counts ``[B]`` after the stage: known on
    the host, read back (one sync) only when a merge step changed the mask."""
    if not changed:
        return counts, [text + n for text, n in zip(call.text_counts, counts, strict=True)], counts_t
    counts_t = (kept & view.visual).sum(dim=1)
    alive, lengths = torch.stack([counts_t, kept.sum(dim=1)]).tolist()
    return alive, lengths, counts_t


def _record(wiring: Wiring, call: CallState, ctx: ScoreContext, view: StageView, scores: torch.Tensor,
            kept: torch.Tensor, alive: list[int], merged: torch.Tensor | None, new: StageView) -> None:
    """The stage in the call's statistics, and a :class:`StageRecord` for every observer."""
    stage = ctx.stage
    call.stats.stage_layers.append(stage.layer)
    call.stats.kept.append(list(alive))
    call.stage_ordinals.append(new.ordinal)
    for observer in wiring.observers:
        observer(StageRecord(stage=stage, score_layer=wiring.scorer.score_layer(stage) if stage.layer else -1,
                             scores=scores, kept=kept, visual=view.visual, ordinal=view.ordinal, counts=list(alive),
                             visual_tokens=call.visual_counts, merged=merged))


def next_view(view: StageView, layout: Layout, lengths: list[int], alive: list[int],
              alive_count: torch.Tensor) -> StageView:
    """Compose ``view`` with the re-padded ``layout`` of a keep mask over its slots (the next stage's view)."""
    return StageView(
        index=torch.gather(view.index, 1, layout.index),
        valid=layout.valid,
        visual=torch.gather(view.visual, 1, layout.index) & layout.valid,
        ordinal=torch.where(layout.valid, torch.gather(view.ordinal, 1, layout.index), -1),
        lengths=lengths,
        alive=alive,
        alive_count=alive_count,
        index_in_previous=layout.index,
    )


def kv_priority(wiring: Wiring, call: CallState, index: int, module: nn.Module, args: tuple, kwargs: dict):
    """KV retention at prefill: record this layer's key priorities ``[B, L]``; every token goes on."""
    hidden = args[0] if args else kwargs["hidden_states"]
    view = call.view
    ctx = ScoreContext(
        hidden=hidden, layer_index=index, layer=module, position_embeddings=kwargs.get("position_embeddings"),
        valid=view.valid, visual=view.visual, ordinal=view.ordinal, num_visual=call.num_visual,
        segments=call.segments, adapter=wiring.adapter, inputs=call.inputs, state=call.method_state,
        visual_counts=call.visual_counts,
    )
    call.method_state.setdefault("kv_priority", {})[index] = wiring.scorer.score(ctx)
    return None


def compact_positions(valid: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` long: each valid slot's rank among its sample's valid slots (``positions="compact"``), 0 on
    padding: what a serving engine that takes only the kept embeddings numbers them."""
    return (valid.long().cumsum(dim=1) - 1).clamp(min=0)
