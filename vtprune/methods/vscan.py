"""VScan (Zhang et al., "VScan: Rethinking Visual Token Reduction for Efficient Large Vision-Language Models",
TMLR 2026, arXiv:2505.22654): global and local scans in the vision tower with merging, then middle-layer pruning.

1. **Tower stage** (pre-LLM, layer 0), per image (or frame), keeping ``T`` of its tokens:
   * *local scan*: ``int(T / 2)`` tokens by the attention they receive at a **shallow** vision layer, spread
     over non-overlapping windows of the token grid (:func:`window_select`);
   * *global scan*: the other ``T - int(T / 2)`` by the attention received at a **deep** layer (the projector's
     feature layer), among the tokens the local scan left;
   * *merging* (:meth:`VScan.merge`): every dropped token joins the kept token whose LLM-input embedding is
     most cosine-similar, and each kept token becomes the mean of itself and the tokens that joined it.
2. **LLM stage** (before the middle layer, 16 of 32, scaled): the last prompt token's attention, recomputed with
   that layer's own q/k on its input (PyramidDrop's rule, which the release reuses), keeps ``keep`` of ``N0``.

Released defaults (Tencent/SelfEvolvingAgent ``VScan/``): LLaVA-1.5 keeps 96 of 576 in the tower and 32 at layer
16 (``llm_ratio = 1/3``; the papers' "64 tokens" is this schedule's layer average), CLS attention of ViT layer 5
(local) and of layer -2 (global, the feature layer), 6 x 6 windows on the 24 x 24 grid, top
``floor(local / 16)`` per window; Qwen2.5-VL keeps 16.7 % in the tower and a third of them at layer 14 of 28,
attention received (mean over queries) at the first full-attention ViT block (local) and at the last block
(global), 4 x 4 windows of merged tokens (rows / columns past the last whole window join it), per window at most
``ceil(local / windows)`` taken in descending attention order. vtprune takes the second rule everywhere
(``rule="greedy"``): where the windows divide the local count (every released LLaVA setting) it keeps exactly
the CLIP release's per-window top-k, and otherwise it still keeps the count (the CLIP release then keeps
fewer tokens; ``rule="topk"`` gives its per-window count, the global scan filling the rest). ``keep`` is the
final fraction; the tower stage keeps ``min(1, keep / llm_ratio)``. Family rules and differences:
docs/methods.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, options, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.schedules import scaled_layer
from vtprune.scoring import ScoreContext

LLM_LAYER = 16  # of 32 (Qwen2.5-VL: 14 of 28, the same middle)
LLM_RATIO = 1 / 3  # 32 of 96 (LLaVA), 0.333 (Qwen2.5-VL)
CLIP_SHALLOW, CLIP_DEPTH, CLIP_WINDOW, CLIP_SIDE = 5, 24, 6, 24
QWEN_SHALLOW, QWEN_DEPTH, QWEN_WINDOW = 7, 32, 4
SHALLOW, DEEP = "vscan_shallow", "vscan_deep"
RULES = ("greedy", "topk")


# -- pure functions ------------------------------------------------------------------------------------------
def window_ids(h: int, w: int, t: int, size: int) -> tuple[torch.Tensor, int]:
    """Window of every token of a ``t x h x w`` grid ``[t h w]`` and the windows per frame: ``size x size``
    windows, rows / columns past the last whole window joining it (at least one window per side)."""
    rows, cols = max(h // size, 1), max(w // size, 1)
    index = torch.arange(t * h * w)
    frame, rest = index // (h * w), index % (h * w)
    row = torch.clamp((rest // w) // size, max=rows - 1)
    col = torch.clamp((rest % w) // size, max=cols - 1)
    return (frame * rows + row) * cols + col, rows * cols


def window_select(values: torch.Tensor, windows: torch.Tensor, count: int, num_windows: int, rule: str = "greedy"
                  ) -> torch.Tensor:
    """The local scan: indices of the tokens kept from ``values`` ``[N]`` by windows ``[N]`` (``-1``: none).

    ``"topk"`` (the release on CLIP): the top ``floor(count / num_windows)`` of every window (fewer in total
    when ``count`` does not divide; windows in id order). ``"greedy"`` (the release on Qwen2.5-VL): tokens in
    descending order, each taken while its window holds fewer than ``ceil(count / num_windows)``, until
    ``count`` are taken. Ties: the earlier token.
    """
    if count <= 0 or num_windows <= 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    if rule == "topk":
        per, chosen = count // num_windows, []
        for window in range(num_windows):
            members = (windows == window).nonzero().flatten()
            order = torch.sort(-values[members].float(), stable=True).indices[: min(per, members.numel())]
            chosen.append(members[order])
        return torch.cat(chosen)
    limit = math.ceil(count / num_windows)
    filled = torch.zeros(num_windows, dtype=torch.long)
    chosen = []
    for index in torch.sort(-values.float(), stable=True).indices.tolist():
        window = int(windows[index])
        if window >= 0 and filled[window] < limit:
            filled[window] += 1
            chosen.append(index)
            if len(chosen) == count:
                break
    return torch.tensor(chosen, dtype=torch.long, device=values.device)


def global_local_scan(shallow: torch.Tensor, deep: torch.Tensor, windows: torch.Tensor, num_windows: int,
                      count: int, global_ratio: float = 0.5, rule: str = "greedy") -> torch.Tensor:
    """Kept indices of one image: the local scan's ``int(count (1 - global_ratio))`` by ``shallow`` ``[N]`` in
    windows, then the global scan's ``count - int(count (1 - global_ratio))`` best of the rest by ``deep`` ``[N]``
    (the release's counts: the total is below ``count`` when ``"topk"`` windows do not divide)."""
    local_count = int(count * (1.0 - global_ratio))
    local = window_select(shallow, windows, local_count, num_windows, rule)
    rest = torch.ones(deep.numel(), dtype=torch.bool, device=deep.device)
    rest[local] = False
    candidates = rest.nonzero().flatten()
    order = torch.sort(-deep[candidates].float(), stable=True).indices[: count - local_count]
    return torch.cat([local, candidates[order]])


def nearest_merge(hidden: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[N, D]``: each dropped token joins the most cosine-similar kept token (ties: the earlier), a kept token
    becomes ``(itself + sum of joined) / (1 + joined)`` (the release's ``token_merging``, ``scaling=1``); dropped
    rows are returned unchanged. hidden: ``[N, D]``; kept: ``[N]`` bool."""
    slots, dropped = kept.nonzero().flatten(), (~kept).nonzero().flatten()
    if dropped.numel() == 0 or slots.numel() == 0:
        return hidden
    x = hidden.float()
    normed = torch.nn.functional.normalize(x, dim=-1)
    target = (normed[dropped] @ normed[slots].T).argmax(dim=-1)
    total = x[slots].clone().index_add_(0, target, x[dropped])
    count = torch.ones(slots.numel(), device=x.device).index_add_(0, target, torch.ones_like(target, dtype=x.dtype))
    out = hidden.clone()
    out[slots] = (total / count[:, None]).to(hidden.dtype)
    return out


def vscan_schedule(num_layers: int, keep: float, llm_ratio: float = LLM_RATIO, layer: int | None = None
                   ) -> tuple[Stage, ...]:
    """``(Stage(0, min(1, keep / llm_ratio)), Stage(L/2, keep))``: the tower stage and the middle-layer stage."""
    middle = scaled_layer(LLM_LAYER, num_layers) if layer is None else max(1, min(num_layers - 1, int(layer)))
    return (Stage(0, min(1.0, keep / llm_ratio)), Stage(middle, keep))


# -- the method ----------------------------------------------------------------------------------------------
@register_method
@dataclass(frozen=True)
class VScan(Scorer):
    """Global + local scans of the vision tower with merging, then last-token attention at the middle layer."""

    name: ClassVar[str] = "vscan"
    # The LLM stage reads ctx.attention (every adapter serves it); "attention" is not declared so that the plan
    # admits the tower stage at layer 0.
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="compact",
                                                 source="Tencent/SelfEvolvingAgent VScan")
    llm_ratio: float = LLM_RATIO
    layer: int | None = None
    global_ratio: float = 0.5
    shallow_layer: int | None = None
    deep_layer: int | None = None
    window: int | None = None
    rule: str = "greedy"
    recycle: bool = True

    def __post_init__(self) -> None:
        options.number(self.llm_ratio, "llm_ratio", 0.0, 1.0, low_open=True,
                       hint=" (share of the tower stage's tokens the LLM stage keeps; release: 1/3)")
        options.number(self.global_ratio, "global_ratio", 0.0, 1.0, hint=" (release: 0.5)")
        options.flag(self.recycle, "recycle")
        for name in ("layer", "shallow_layer", "deep_layer"):
            if getattr(self, name) is not None:
                options.integer(getattr(self, name), name, 0)
        if self.window is not None:
            options.integer(self.window, "window", 1)
        if self.rule not in RULES:
            raise ValueError(f"rule={self.rule!r}: use 'greedy' (at most ceil(local / windows) per window; the release "
                             "on Qwen, and on CLIP whenever windows divide the count) or 'topk' (floor(local / windows) "
                             "per window, the CLIP release's rule; the global scan fills the rest).")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return vscan_schedule(num_layers, keep, self.llm_ratio, self.layer)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """The shallow and deep vision layers' attention maps (read by a tower stage at layer 0)."""
        if not any(s.layer == 0 for s in stages):
            return ()
        shallow, deep = self.vit_layers(adapter)
        return (*tower.captures(adapter, SHALLOW, shallow, self.name), *tower.captures(adapter, DEEP, deep, self.name))

    def vit_layers(self, adapter: Any) -> tuple[int, int]:
        """``(shallow, deep)`` vision layers: CLIP / SigLIP layer 5 of 24 (scaled) and the feature layer; Qwen-VL
        the first full-attention block at or after 7 of 32 (scaled) and the last full-attention block."""
        deep = tower.resolve_layer(adapter, self.deep_layer, self.name, "deep_layer")
        if self.shallow_layer is not None:
            return tower.resolve_layer(adapter, self.shallow_layer, self.name, "shallow_layer"), deep
        depth = tower.vit_depth(adapter)
        if not tower.is_qwen(adapter):
            return min(depth - 1, round(CLIP_SHALLOW * depth / CLIP_DEPTH)), deep
        full = adapter.vit_full_attention_blocks()
        start = round(QWEN_SHALLOW * depth / QWEN_DEPTH)
        return next((b for b in full if b >= start), full[-1]), deep

    def window_size(self, adapter: Any) -> int:
        """Window side in LLM tokens: the option, 4 merged tokens on Qwen-VL, else 6 of a 24-token crop side."""
        if self.window is not None:
            return int(self.window)
        if tower.is_qwen(adapter):
            return QWEN_WINDOW
        vision = adapter.config.vision_config
        return max(1, round(CLIP_WINDOW * (vision.image_size // vision.patch_size) / CLIP_SIDE))

    # -- scoring -------------------------------------------------------------------------------------------
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if ctx.layer is not None:  # the LLM stage
            return ctx.attention("last")
        return self.tower_scores(ctx)

    def tower_scores(self, ctx: ScoreContext) -> torch.Tensor:
        """Scores of the tower stage: the scans' picks first (2 + deep attention / its maximum), then the rest by
        deep attention."""
        shallow, _ = tower.token_maps(ctx, SHALLOW, self.name)
        deep, _ = tower.token_maps(ctx, DEEP, self.name)
        size, rule = self.window_size(ctx.adapter), self.rule

        def values(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            ordinal = ctx.ordinal[row]
            out = deep[row].gather(0, ordinal.clamp(min=0)).float()
            out = out / out.abs().max().clamp_min(1e-12)  # in [0, 1] (Qwen sums 4 patches): the picks' +2 ranks first
            windows, counts = sample_windows(ctx.segments[row], ctx.visual_counts[row], size)
            for group in range(quota.numel()):
                members = ((groups == group) & (ordinal >= 0)).nonzero().flatten()
                if members.numel() == 0:
                    continue
                ids = windows[ordinal[members].cpu()]
                local_ids, num = renumber(ids)
                picks = global_local_scan(shallow[row, ordinal[members]], deep[row, ordinal[members]],
                                          local_ids.to(members.device), num, int(quota[group]),
                                          self.global_ratio, rule)
                out[members[picks]] += 2.0
            return out

        return lm_inputs.per_image_scores(ctx, values)

    def merge(self, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """At the tower stage (layer 0, ``hidden`` = the LLM-input embeddings): per image, the dropped tokens merge
        into their most similar kept token."""
        alive = ctx.visual & ctx.valid
        if not self.recycle or ctx.layer is not None or not bool((alive & ~kept).any()):
            return kept, hidden
        hidden = hidden.clone()
        for row in range(kept.shape[0]):
            if ctx.visual_counts[row] == 0:
                continue
            groups = lm_inputs.group_ids(ctx, row)
            for group in groups[alive[row]].unique().tolist():
                members = (alive[row] & (groups == group)).nonzero().flatten()
                hidden[row, members] = nearest_merge(hidden[row, members], kept[row, members])
        return kept, hidden


def sample_windows(segments: list, count: int, size: int) -> tuple[torch.Tensor, int]:
    """Window id ``[count]`` of each visual token of a sample (``-1``: outside a grid), unique over its segments
    and frames, and the number of ids."""
    out = torch.full((count,), -1, dtype=torch.long)
    offset = 0
    for segment in segments:
        ids, per_frame = window_ids(segment.h, segment.w, segment.t, size)
        begin = segment.start + segment.extra
        end = min(count, begin + ids.numel())
        if end > begin:
            out[begin:end] = offset + ids[: end - begin]
        offset += per_frame * segment.t
    return out, offset


def renumber(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Window ids of one image renumbered ``0..n-1`` in order (``-1`` kept) and ``n``."""
    present = ids[ids >= 0].unique()
    lookup = torch.full((int(ids.max()) + 2 if ids.numel() else 1,), -1, dtype=torch.long)
    lookup[present] = torch.arange(present.numel())
    return torch.where(ids >= 0, lookup[ids.clamp(min=0)], ids), int(present.numel())

