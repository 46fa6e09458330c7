"""Temporal redundancy pruning for video, in the style of EVS (Bagrov et al., arXiv:2510.14624).

A visual token that barely changed since the previous frame, at the same spatial position, adds little:
it is scored by its **dissimilarity** ``1 - cos(x_t, x_{t-1})`` to that token, on the embeddings entering
the language model (after the projector / patch merger), and the top ``keep`` of the sample's visual tokens
are kept (a static scene keeps less of each later frame, a moving one more). The first frame of every video
has no previous frame and is kept whole (score above any dissimilarity), as in EVS, whenever the budget
allows; when ``keep`` is below the first frame's share, its tokens that stay unchanged in the next frame
are kept first (no later token repeats them). Kept tokens keep their original (M-RoPE ``t, h, w``) positions.

Frames: a Qwen video segment with ``t > 1`` temporal patches is ``t`` frames of ``h x w`` tokens (one frame =
one temporal patch, two video frames on Qwen2/2.5-VL); frames passed as images are one frame per image
segment, each compared with the latest earlier image segment of the same grid (LLaVA-NeXT's base view with
base view, tile grid with tile grid). A sample with no frame to compare (a single image, or images of
different grids) is refused: the method needs video. Pre-LLM (stage at layer 0); Qwen3-VL prunes at layer
``n`` on the embeddings that entered the LLM. Composes with GridProbe (frames first, then this), and with
any token method after it: ``then="fastv"`` keeps ``retain`` of the tokens pre-LLM by temporal redundancy,
then the token method prunes to ``keep`` at its own layers, ranking within each frame (``per_frame``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.adapters.base import VisualSegment
from vtprune.config import Stage
from vtprune.methods import lm_inputs, options
from vtprune.methods.base import Capture, Scorer, merge_step
from vtprune.methods.per_frame import PerFrame
from vtprune.methods.registry import register_method, resolve
from vtprune.scoring import ScoreContext

FIRST = 3.0  # above any dissimilarity (1 - cos <= 2): first frames are kept first


# -- pure functions ----------------------------------------------------------------------------------------
def previous_positions(segments: list[VisualSegment], total: int) -> torch.Tensor:
    """``[total]`` long: the ordinal of the same position in the previous frame, ``-1`` for first frames.

    A ``t > 1`` segment's frame ``f > 0`` follows frame ``f - 1`` of the same segment (its ``extra`` tokens have
    none); a ``t == 1`` segment follows the latest earlier ``t == 1`` segment of the same ``(kind, h, w, extra)``.
    """
    previous = torch.full((total,), -1, dtype=torch.long)
    latest: dict[tuple, int] = {}
    for segment in segments:
        start, per = segment.start, segment.h * segment.w
        if segment.t > 1:
            for frame in range(1, segment.t):
                begin = start + frame * per
                end = min(total, begin + per)
                if end > begin:
                    previous[begin:end] = torch.arange(begin - per, end - per)
            continue
        shape = (segment.kind, segment.h, segment.w, segment.extra)
        end = min(total, start + segment.length)
        if shape in latest and end > start:
            previous[start:end] = torch.arange(latest[shape], latest[shape] + end - start)
        latest[shape] = start
    return previous


def temporal_scores(x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Scores ``[N]`` (fp32) of one sample's visual tokens ``x`` ``[N, D]`` given :func:`previous_positions`.

    With a previous frame: ``1 - cos(x_i, x_prev)`` in ``[0, 2]``. First-frame tokens: ``FIRST + 1 + cos(x_i,
    x_next)`` with the token that follows them (``FIRST`` when none), so they rank above every other token,
    the ones unchanged in the next frame first.
    """
    normed = torch.nn.functional.normalize(x.float(), dim=-1)
    has = previous >= 0
    source = previous.clamp(min=0).to(normed.device)
    cos = (normed * normed[source]).sum(dim=-1)
    follow = torch.full_like(cos, float("nan"))
    follow[previous[has].to(normed.device)] = cos[has.to(normed.device)]  # cos of each token with its successor
    first = FIRST + torch.nan_to_num(1.0 + follow, nan=0.0)
    return torch.where(has.to(normed.device), 1.0 - cos, first)


@register_method
@dataclass(frozen=True)
class Temporal(Scorer):
    """Drop video tokens nearly unchanged since the previous frame, first frame whole, pre-LLM (EVS-style)."""

    name: ClassVar[str] = "temporal"
    then: str | None = None
    then_options: dict[str, Any] | None = None
    retain: float = 0.5
    frame_budget: str = "per_frame"

    def __post_init__(self) -> None:
        options.number(self.retain, "retain", 0.0, 1.0, low_open=True,
                       hint=" (the fraction the temporal stage keeps before then=)")
        if self.then_options is not None and not isinstance(self.then_options, dict):
            raise ValueError(f"then_options={self.then_options!r} must be a dict of options of the then= method.")
        if self.frame_budget not in ("per_frame", "global"):
            raise ValueError(f"frame_budget={self.frame_budget!r}: use 'per_frame' or 'global'.")
        if self.then is not None:
            if not isinstance(self.then, str) or self.then.split("+")[0] in ("temporal", "per_frame"):
                raise ValueError(f"then={self.then!r} must name a token method such as 'fastv' or 'pdrop'.")
            inner = resolve(self.then, dict(self.then_options or {}))
            if inner.kv_retention() is not None:
                raise ValueError(f"then={self.then!r} evicts KV-cache entries instead of pruning tokens, so it cannot "
                                 "follow temporal's stage; use a method that prunes inside the LLM ('fastv', "
                                 "'pdrop', 'dart', ...).")
            if merge_step(inner) is not None or any(s.layer == 0 for s in inner.schedule(32, 0.25)):
                raise ValueError(f"then={self.then!r} must be a method that scores inside the LLM ('fastv', "
                                 "'pdrop', 'dart', ...); a pre-LLM or merging method cannot follow temporal.")
            inner = PerFrame(inner=inner) if self.frame_budget == "per_frame" else inner
            object.__setattr__(self, "_then", inner)

    @property
    def follower(self) -> Scorer | None:
        """The token method run after the temporal stage (``then=``), or None."""
        return getattr(self, "_then", None)

    @property
    def requires(self) -> frozenset[str]:  # type: ignore[override]
        # The first stage (pre-LLM) is temporal's own; what the follower needs at its layers is offered by
        # every adapter ("attention", "llm_layers"), so it is not held against the pre-LLM stage.
        return frozenset()

    @property
    def score_offset(self) -> int:  # type: ignore[override]
        return self.follower.score_offset if self.follower is not None else 0

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        if self.follower is None:
            return (Stage(0, keep),)
        first = max(float(self.retain), keep)
        later = [Stage(s.layer, min(s.keep, first)) for s in self.follower.schedule(num_layers, keep) if s.layer > 0]
        return (Stage(0, first), *later)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        own = (lm_inputs.lm_input_capture(adapter),) if stages and stages[0].layer > 0 else ()
        follower = self.follower.captures(adapter, stages[1:]) if self.follower is not None else ()
        return (*own, *follower)

    def table(self, ctx: ScoreContext) -> torch.Tensor:
        """``[B, N0max + 1]`` score of every original visual token by ordinal (computed once per call)."""
        table = ctx.state.get("temporal")
        if table is not None:
            return table
        embeddings = lm_inputs.embedding_table(ctx)
        table = torch.zeros(embeddings.shape[:2], dtype=torch.float32, device=embeddings.device)
        for row, total in enumerate(ctx.visual_counts):
            if total == 0:
                continue
            previous = previous_positions(ctx.segments[row], total)
            if not bool((previous >= 0).any()):
                frames = len(ctx.segments[row])
                raise ValueError(
                    f"method 'temporal' prunes tokens repeated across video frames, but sample {row} has {frames} "
                    f"visual segment(s) with no earlier frame of the same grid to compare with (a single image, or "
                    "images of different sizes). Pass a video (a Qwen video input, or its frames as images) or use "
                    "an image method such as 'divprune', 'visionzip' or 'fastv'.")
            table[row, :total] = temporal_scores(embeddings[row, :total], previous)
        ctx.state["temporal"] = table
        return table

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.stage_index > 0 and self.follower is not None:
            return self.follower.score(ctx)
        table = self.table(ctx).to(ctx.valid.device)
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return torch.where(ctx.ordinal >= 0, values, torch.zeros_like(values))
