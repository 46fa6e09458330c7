"""Per-frame token budgets for video (and multi-image) inputs, as a wrapper around any pruning method.

``frame_budget="global"`` (the engine's rule) keeps the top ``keep_count(keep, N0)`` visual tokens of a sample
wherever they are, so a few salient frames can take the whole budget. ``frame_budget="per_frame"`` makes every
frame keep its own top fraction: the wrapped method scores as usual, then the scores are replaced by ranks
within each frame, scaled by the frame's quota ``q_f = keep_count(keep, n_f)`` (``n_f`` the frame's original
tokens)::

    score'(token) = -(rank_in_frame + 1) / q_f         (rank 0 = the frame's best token)

The engine's global top-``keep_count(keep, N0)`` over these values takes exactly each frame's top ``q_f``
tokens when ``sum_f q_f`` equals the global count; rounding differences are settled by the next-best
``(rank + 1) / q_f`` (largest remaining share), ties to the earlier token. The engine is not changed.

Frames: with frames passed as images every image segment is one frame; a segment with ``t > 1`` temporal
positions (Qwen video tokens) splits into ``t`` frames of ``h * w`` tokens (one frame = one temporal patch,
i.e. two video frames for Qwen2/2.5-VL), extra tokens counted with the segment's last frame; a flat segment
without a grid is one frame.

Debiasing (``+debias``) runs inside the wrapped method before the ranking, with ``x = ordinal / N_total``
over the whole sequence. Under per-frame budgets only its within-frame ordering survives: across frames the
quotas replace the recency correction, and inside a frame the correction spans ``sigma * n_f / N_total``
(nearly flat when there are many frames).

Use ``PerFrame(FastV())`` as a scorer, ``vtprune.wrap(model, "per_frame", keep=0.25, base="fastv",
base_options={...})`` (``"per_frame+debias"`` debiases the base method), or
:func:`vtprune.gridprobe.wrap_frames` (``frame_budget="per_frame"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vtprune.adapters.base import VisualSegment
from vtprune.methods.base import Scorer, Wrapper
from vtprune.methods.registry import register_method, resolve
from vtprune.scoring import ScoreContext


def frame_ids(segments: list[VisualSegment], total: int) -> torch.Tensor:
    """``[total]`` long: the frame of each visual token of one sample (see the module docstring)."""
    ids = torch.zeros(total, dtype=torch.long)
    frame, covered = 0, 0
    for segment in segments:
        start, length = segment.start, segment.length
        if segment.t > 1:
            per = segment.h * segment.w
            local = torch.arange(length) // max(per, 1)
            ids[start:start + length] = frame + local.clamp(max=segment.t - 1)
            frame += segment.t
        else:
            ids[start:start + length] = frame
            frame += 1
        covered = max(covered, start + length)
    if covered < total:  # tokens the adapter could not attribute form one last frame
        ids[covered:] = frame
    return ids


def per_frame_scores(scores: torch.Tensor, alive: torch.Tensor, frames: torch.Tensor, quota: torch.Tensor
                     ) -> torch.Tensor:
    """Quota-scaled within-frame ranks for one sample.

    scores: ``[L]`` float; alive: ``[L]`` bool (slots that may be kept); frames: ``[L]`` long frame id of each
    slot (any value where not alive); quota: ``[F]`` tokens each frame keeps. Returns ``[L]`` fp32,
    ``-(rank + 1) / quota[frame]`` on alive slots and ``-inf`` elsewhere.
    """
    out = torch.full(scores.shape, float("-inf"), dtype=torch.float32, device=scores.device)
    index = alive.nonzero().flatten()
    if index.numel() == 0:
        return out
    value, frame = scores[index].float(), frames[index]
    by_score = torch.sort(-value, stable=True).indices  # best first, ties to the earlier slot
    order = by_score[torch.sort(frame[by_score], stable=True).indices]  # grouped by frame, best first
    sorted_frames = frame[order]
    starts = torch.searchsorted(sorted_frames, sorted_frames, right=False)
    rank = torch.arange(order.numel(), device=scores.device) - starts
    priority = (rank + 1).float() / quota.to(scores.device)[sorted_frames].clamp_min(1).float()
    out[index[order]] = -priority
    return out


@dataclass(frozen=True)
class PerFrame(Wrapper):
    """Every frame (image) keeps its own top ``keep`` fraction of its tokens, ranked by the inner scorer."""

    def __post_init__(self) -> None:
        if self.inner.kv_retention() is not None:
            raise ValueError(
                f"per-frame budgets share a sample's kept tokens among its frames, but method {self.inner.name!r} "
                "keeps every token and evicts KV-cache entries per layer instead; use it without per_frame / "
                "frame_budget='per_frame', or give per_frame a token method such as base='fastv'.")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        raw = self.inner.score(ctx)
        out = torch.zeros(raw.shape, dtype=torch.float32, device=raw.device)
        alive = ctx.visual & ctx.valid
        for row in range(raw.shape[0]):
            total = int(ctx.num_visual[row])
            if total == 0:
                continue
            ids = frame_ids(ctx.segments[row], total).to(raw.device)
            counts = torch.bincount(ids, minlength=int(ids.max()) + 1)
            quota = torch.tensor([ctx.kept_count(int(n)) for n in counts.tolist()], device=raw.device)
            frames = ids[ctx.ordinal[row].clamp(min=0, max=total - 1)]
            out[row] = per_frame_scores(raw[row], alive[row], frames, quota).nan_to_num(neginf=-1e9)
        return out


@register_method(name="per_frame")
def per_frame(base: str = "fastv", base_options: dict[str, Any] | None = None, debias: bool | str = False) -> Scorer:
    """Per-frame budgets around method base= (video / multi-image)."""
    if not isinstance(base, str) or base.split("+")[0] in ("per_frame", "gridprobe"):
        raise ValueError(f"per_frame needs a token method as base=, e.g. base='fastv', got {base!r}.")
    return PerFrame(inner=resolve(base, dict(base_options or {}), debias=debias))
