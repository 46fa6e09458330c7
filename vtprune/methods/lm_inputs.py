"""What pre-LLM methods rank on: the visual embeddings entering the language model, and per-image groups.

* :func:`input_embeddings` gives ``[B, L, D]`` embeddings of the current slots as they entered the first
  decoder layer (after the projector / patch merger). At a pre-LLM stage (layer 0) they are ``ctx.hidden``;
  at a later stage (Qwen3-VL, whose DeepStack features forbid pruning before layer ``n``) they come from a
  pre-hook on the language model (:func:`lm_input_capture`), aligned by visual ordinal. The table is built
  once per call, so a later stage of the same call reuses the original embeddings.
* :func:`instruction_embeddings` gives ``[B, Q, D]`` LM-input embeddings of each sample's own instruction tokens
  (the text after its last visual token, :meth:`~vtprune.scoring.ScoreContext.instruction_queries`), for
  text-conditioned selections (CDPruner, MMTok); read once per call, before any stage prunes.
* :func:`group_ids` / :func:`group_quotas`: images (or frames) of a sample, as
  :func:`vtprune.methods.per_frame.frame_ids` defines them, and each one's share of the budget.
* :func:`group_scores`: scores that make the engine keep each group's own top ``keep`` fraction by a
  per-slot value (the rule of :mod:`vtprune.methods.per_frame`); :func:`per_image_scores` runs it over a
  batch with a per-sample value function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vtprune.methods.base import Capture
from vtprune.methods.per_frame import frame_ids, per_frame_scores
from vtprune.scoring import ScoreContext

TABLE = "lm_input_table"
CAPTURED = "lm_input_embeds"
INSTRUCTION = "lm_instruction_embeds"


def lm_input_capture(adapter: Any) -> Capture:
    """A pre-hook on the language model that keeps the call's ``inputs_embeds`` (read only at stages > 0)."""
    return Capture(adapter.language_model, _grab, before=True)


def _grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and CAPTURED not in state:
        state[CAPTURED] = embeds


def instruction_embeddings(ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, Q, D], [B, Q] bool)``: the LM-input embedding of each sample's instruction tokens and their mask.

    The instruction is the valid text after the sample's last visual token (the engine's instruction span); a
    sample without one has an all-False row. Built at the call's first stage (nothing is pruned yet, so the
    slots are the prompt's positions: at layer 0 ``ctx.hidden`` is the LM input, later the captured input of
    :func:`lm_input_capture`, which must be read before :func:`embedding_table` consumes it) and kept for the call.
    """
    cached = ctx.state.get(INSTRUCTION)
    if cached is not None:
        return cached
    index, mask = ctx.instruction_queries()
    source = ctx.hidden if ctx.layer_index < 0 else ctx.state.get(CAPTURED)
    if source is None:
        raise RuntimeError(f"the stage at layer {ctx.stage.layer} found no language-model input embeddings "
                           "for this call (the scorer must register lm_input_capture).")
    index = index.to(source.device)
    values = source.gather(1, index[..., None].expand(-1, -1, source.shape[-1]))
    text = (ctx.valid & ~ctx.visual).to(source.device).gather(1, index)
    cached = ctx.state[INSTRUCTION] = (values, mask.to(source.device) & text)
    return cached


def embedding_table(ctx: ScoreContext) -> torch.Tensor:
    """``[B, N0max, D]`` embedding of every original visual token by ordinal (built once per call)."""
    table = ctx.state.get(TABLE)
    if table is not None:
        return table
    counts = ctx.visual_counts
    if ctx.layer_index < 0:  # the pre-LLM stage: the slots are the LM input itself
        hidden, ordinal, visual = ctx.hidden, ctx.ordinal, ctx.visual & ctx.valid
    else:
        hidden = ctx.state.pop(CAPTURED, None)
        ids = ctx.inputs.get("input_ids")
        if hidden is None or ids is None:
            raise RuntimeError(f"the stage at layer {ctx.stage.layer} found no language-model input embeddings "
                               "for this call (the scorer must register lm_input_capture).")
        visual = ctx.adapter.visual_mask(ids).to(hidden.device)
        ordinal = (visual.long().cumsum(dim=1) - 1).masked_fill(~visual, -1)
    table = hidden.new_zeros(len(counts), max(counts, default=0) + 1, hidden.shape[-1])
    rows, cols = visual.nonzero(as_tuple=True)
    table[rows, ordinal[rows, cols]] = hidden[rows, cols]
    ctx.state[TABLE] = table
    return table


def input_embeddings(ctx: ScoreContext) -> torch.Tensor:
    """``[B, L, D]`` LM-input embedding of each current slot (zeros where the slot is not a visual token)."""
    table = embedding_table(ctx).to(ctx.hidden.device)
    index = ctx.ordinal.clamp(min=0).to(table.device)
    values = table.gather(1, index[..., None].expand(-1, -1, table.shape[-1]))
    return values.masked_fill((ctx.ordinal < 0)[..., None].to(values.device), 0.0)


def group_ids(ctx: ScoreContext, row: int) -> torch.Tensor:
    """``[L]`` long: the group (image, or frame of a video) of each slot of sample ``row``; -1 elsewhere."""
    total = ctx.visual_counts[row]
    ordinal = ctx.ordinal[row]
    if total == 0:
        return torch.full_like(ordinal, -1)
    ids = frame_ids(ctx.segments[row], total).to(ordinal.device)
    return torch.where(ordinal >= 0, ids[ordinal.clamp(min=0, max=total - 1)], torch.full_like(ordinal, -1))


def group_quotas(ctx: ScoreContext, row: int, keep: float) -> torch.Tensor:
    """``[G]`` tokens each group of sample ``row`` keeps of its original ``n_g`` at ``keep`` (the plan's rule,
    :meth:`~vtprune.scoring.ScoreContext.kept_count`)."""
    total = ctx.visual_counts[row]
    ids = frame_ids(ctx.segments[row], total)
    counts = torch.bincount(ids, minlength=int(ids.max()) + 1 if total else 0).tolist()
    return torch.tensor([ctx.kept_count(int(n), keep) for n in counts], dtype=torch.long)


def group_scores(values: torch.Tensor, alive: torch.Tensor, groups: torch.Tensor, quota: torch.Tensor
                 ) -> torch.Tensor:
    """Engine scores ``[L]`` that keep each group's own top ``quota[g]`` slots by ``values`` (one sample).

    values: ``[L]`` higher is better (ties: the earlier slot); alive: ``[L]`` bool; groups: ``[L]`` long;
    quota: ``[G]``. The engine's global top-k then takes each group's best ``quota[g]`` slots; rounding
    differences go to the largest remaining share (:func:`~vtprune.methods.per_frame.per_frame_scores`).
    """
    out = per_frame_scores(values, alive, groups.clamp(min=0), quota.to(values.device))
    return out.nan_to_num(neginf=-1e9)


def per_image_scores(ctx: ScoreContext, values: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """Engine scores ``[B, L]``: every image (group) of a sample keeps its own share of the stage's ``keep``.

    values: ``(row, groups [L], quota [G]) -> [L]`` per-slot values of one sample, higher is better. Samples
    without visual tokens score 0 (nothing to choose).
    """
    alive = ctx.visual & ctx.valid
    out = torch.zeros(ctx.valid.shape, dtype=torch.float32, device=ctx.valid.device)
    for row in range(out.shape[0]):
        if ctx.visual_counts[row] == 0:
            continue
        groups = group_ids(ctx, row)
        quota = group_quotas(ctx, row, ctx.stage.keep)
        out[row] = group_scores(values(row, groups, quota), alive[row], groups, quota)
    return out
