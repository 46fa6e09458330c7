"""SparseVLM (Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model
Inference", ICML 2025, arXiv:2410.04417): text raters, rater-to-visual attention, recycling of deleted tokens.

1. **Raters** (paper Sec. 3.2), once per call on the language model's input embeddings: with ``V`` ``[Nv, D]``
   the sample's visual embeddings and ``T`` ``[Nt, D]`` its text after the last visual token,
   ``r = mean_v softmax_t(V T^T)`` ``[Nt]``; the raters are the text tokens with ``r_t > mean(r)``.
2. **Scores** at each stage: head- and rater-averaged attention of the raters to every visual token,
   recomputed from the scoring layer's q/k (the layer whose *output* the release prunes: ``score_offset = 1``).
3. **Recycling** (the :meth:`SparseVLM.merge` step): of the ``n`` visual tokens a stage deletes, the
   ``int(0.3 n) + 1`` with the highest score are clustered into ``int(m / 10) + 1`` groups by density-peak
   k-NN clustering (:func:`dpc_knn`, TCFormer's DPC-kNN as the release runs it) and each group's mean is kept
   as a new visual token (written into the slot of the group's centre), so a stage keeps ``k + clusters``.

Schedule (release: prune the outputs of 0-based layers 2, 6, 15 of 32, i.e. before layers 3, 7, 16; scaled
to other depths, colliding stages merged). The release's presets (``RETAIN_TOKN`` 192 / 128 / 96 / 64: the
*layer-averaged* count) keep fixed counts of 576 at the three stages (:data:`PRESETS`); ``retain=`` gives a
preset exactly (as fractions of ``N0``). Without it ``keep`` is, as everywhere in vtprune, the last stage's
fraction, and the earlier stages follow the shape of the preset whose last fraction is nearest to ``keep``.

Release: Gumpest/SparseVLMs ``main`` (26a5f48, ``USE_VERSION=1_0``, identical to the ``v1.5`` branch head
734d900 in this selection). The paper's rank-based count (the repository's first commit, 91fb6d9) is
``count="rank"``: at four stages (after layers 2, 6, 15, 19 of 32) each sample keeps ``min(int(rank(P) 13.5),
N - 1)`` of its ``N`` visual tokens (all when ``rank(P) = N``), ``P`` the head-mean rater-to-visual attention
rows (:func:`rank_count`), so ``keep`` is unused; every release since v1.5 uses the fixed presets, the default.
Differences (docs/methods.md): per sample in a batch (the release
runs batch 1); float32 rater selection; no random 1e-6 jitter on the cluster densities (ties: the earlier
token); merged tokens sit in their centre's slot and keep its position (the release appends them after the
kept visual tokens and renumbers positions: ``parity="release"`` compacts positions, not the order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.kernels import visual_attention_scores
from vtprune.methods import lm_inputs, options
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.debias import ReleaseDebias, Trend
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.schedules import scaled_layer
from vtprune.scoring import ScoreContext

RELEASE_LAYERS = (2, 6, 15)  # of 32: the release prunes these layers' outputs (stages before 3, 7, 16)
RELEASE_TOKENS = 576
PRESETS = {192: (300, 200, 110), 128: (303, 110, 36), 96: (238, 48, 26), 64: (66, 30, 17)}
RATERS = "sparsevlm_raters"
RANKS = "sparsevlm_ranks"
RANK_LAYERS, RANK_SCALE = (2, 6, 15, 19), 13.5  # the first release (91fb6d9): pruning_loc, scale
COUNTS = ("preset", "rank")
#: The debiasing release's SparseVLM patch (intcomp/attention-bias): per-benchmark ``exp(-sigma x)`` weights (sigma
#: 1.33-2.67, mean 1.95) with the padding mask (``tau`` about 0.5) at the first sparsification layer only.
SPARSEVLM_DEBIAS = ReleaseDebias(Trend(sigma=1.95), tau=0.5, first_stage_only=True)


# -- pure functions ------------------------------------------------------------------------------------------
def text_raters(visual: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Rater mask ``[Nt]`` bool: ``mean_v softmax_t(V T^T) > its mean`` (SparseVLM Sec. 3.2).

    visual: ``[Nv, D]``, text: ``[Nt, D]`` input embeddings of one sample (float32 here).
    """
    relevance = (visual.float() @ text.float().T).softmax(dim=1).mean(dim=0)
    return relevance > relevance.mean()


def recycle_count(deleted: int, ratio: float = 0.3, group: int = 10) -> tuple[int, int]:
    """``(m, c)``: of ``deleted`` tokens the release recycles ``m = int(ratio n) + 1`` into ``c = int(m / group) + 1``
    clusters (``(0, 0)`` when nothing is deleted)."""
    if deleted <= 0:
        return 0, 0
    recycled = min(deleted, int(deleted * ratio) + 1)
    return recycled, min(recycled, int(recycled / group) + 1)


def dpc_knn(x: torch.Tensor, clusters: int, jitter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Density-peak k-NN clustering of ``x`` ``[N, C]`` into ``clusters`` groups: ``(centres [c], assign [N])``.

    Distances ``||x_i - x_j|| / sqrt(C)``; density ``exp(-mean d^2)`` over the ``clusters`` nearest (itself
    included); ``delta_i`` the distance to the nearest denser token (the largest distance for the densest);
    centres: the ``clusters`` largest ``delta * density``; every token joins its nearest centre, a centre
    itself. ``assign`` indexes ``centres``. (Du et al., DPC-KNN; TCFormer, CVPR 2022, as SparseVLM's release.)
    Equal densities (one cluster: all 1; mutual nearest neighbours) are broken by ``jitter`` ``[N]`` added to the
    density when given (the release adds ``U(0, 1e-6)`` noise), else the earlier token counts as denser.
    """
    x = x.float()
    distance = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / x.shape[-1] ** 0.5
    nearest = torch.topk(distance, k=clusters, dim=-1, largest=False).values
    density = (-(nearest ** 2).mean(dim=-1)).exp()
    if jitter is not None:
        density = density + jitter.to(density)
    order = torch.arange(x.shape[0], device=x.device)
    tie = (density[None, :] == density[:, None]) & (order[None, :] < order[:, None])
    denser = (density[None, :] > density[:, None]) | tie  # [i, j]: j counts as denser than i
    delta = torch.where(denser, distance, distance.max()).min(dim=-1).values
    centres = torch.topk(delta * density, k=clusters).indices
    assign = distance[centres].argmin(dim=0)
    assign[centres] = torch.arange(clusters, device=x.device)
    return centres, assign


def cluster_means(x: torch.Tensor, assign: torch.Tensor, clusters: int) -> torch.Tensor:
    """``[c, C]`` mean of each cluster's members (``sum / (count + 1e-6)``, the release's average)."""
    total = x.new_zeros(clusters, x.shape[-1], dtype=torch.float32).index_add_(0, assign, x.float())
    count = torch.bincount(assign, minlength=clusters).to(total.dtype)
    return total / (count[:, None] + 1e-6)


def recycle_deleted(hidden: torch.Tensor, relevance: torch.Tensor, ratio: float = 0.3, group: int = 10,
                    jitter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Recycling of one stage's deleted tokens: ``(centre indices [c] into the deleted tokens, merged [c, D])``.

    hidden: ``[n, D]`` the deleted tokens (stage order), relevance: ``[n]`` their scores. The ``m`` most
    relevant (:func:`recycle_count`) are clustered (:func:`dpc_knn`, ``jitter`` ``[m]`` in their order) and
    averaged per cluster.
    """
    recycled, clusters = recycle_count(relevance.numel(), ratio, group)
    if clusters == 0:
        return relevance.new_zeros(0, dtype=torch.long), hidden[:0]
    chosen = torch.topk(relevance.float(), recycled).indices
    centres, assign = dpc_knn(hidden[chosen], clusters, jitter)
    return chosen[centres], cluster_means(hidden[chosen], assign, clusters)


def rater_rows(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
               scaling: float) -> torch.Tensor:
    """Head-mean causal attention rows ``[B, R, L]`` (fp32) of the rater queries ``[B, H, R, d]`` at ``positions``
    ``[B, R]`` over keys ``[B, H_kv, L, d]`` (``key_valid`` ``[B, L]``), softmax over every valid key."""
    heads, kv_heads = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // kv_heads, dim=1).float()
    logits = query.float() @ key.transpose(-1, -2) * scaling
    slots = torch.arange(key.shape[2], device=key.device)
    allowed = key_valid[:, None, None, :].to(key.device) & (slots[None, None, None, :] <= positions[:, None, :, None])
    return logits.masked_fill(~allowed, float("-inf")).softmax(dim=-1).mean(dim=1)


def rank_count(rows: torch.Tensor, alive: int, scale: float = RANK_SCALE, bias: float = 0.0) -> int:
    """Tokens the paper's rank rule keeps (the first release, ``attn_postprocess_rank``): ``r = rank(P)`` of the
    rater-to-visual attention ``P`` ``[R, N]``; all ``N`` when ``r = N``, else ``min(int(r scale + bias), N - 1)``."""
    rank = int(torch.linalg.matrix_rank(rows.float()))
    return alive if alive == rank else min(int(rank * scale + bias), alive - 1)


def stage_layers(num_layers: int, layers: tuple[int, ...] = RELEASE_LAYERS) -> list[int]:
    """Stage layers (0-based "prune before") for the release's pruned outputs ``layers`` of 32, scaled; a stage
    that would collide with the previous one moves one layer on, and one past the last layer is dropped."""
    out: list[int] = []
    for layer in layers:
        stage = max(scaled_layer(layer, num_layers) + 1, out[-1] + 1 if out else 1)
        if stage <= num_layers - 1:
            out.append(stage)
    return out or [max(1, num_layers - 1)]


def schedule_keeps(keep: float, retain: int | None = None) -> tuple[float, float, float]:
    """Three cumulative fractions of ``N0``: a release preset's (``retain``), or ending at ``keep`` in the shape
    of the preset whose last fraction is nearest to ``keep`` (log scale)."""
    if retain is not None:
        return tuple(c / RELEASE_TOKENS for c in PRESETS[retain])  # type: ignore[return-value]
    if keep >= 1.0:
        return (1.0, 1.0, 1.0)
    target = torch.log(torch.tensor(max(keep, 1e-9)))
    preset = min(PRESETS.values(), key=lambda c: abs(float(torch.log(torch.tensor(c[-1] / RELEASE_TOKENS)) - target)))
    return tuple(min(1.0, keep * c / preset[-1]) for c in preset)  # type: ignore[return-value]


def sparsevlm_schedule(num_layers: int, keep: float, retain: int | None = None, count: str = "preset"
                       ) -> tuple[Stage, ...]:
    """SparseVLM's stages: before layers 3, 7, 16 of 32 (scaled) with :func:`schedule_keeps`; when the depth
    leaves fewer stages, the last one keeps the last fraction. ``count="rank"``: before 3, 7, 16, 20 keeping 1.0
    (the merge step then keeps the rank rule's count, :func:`rank_count`)."""
    if count == "rank":
        return tuple(Stage(layer, 1.0) for layer in stage_layers(num_layers, RANK_LAYERS))
    layers = stage_layers(num_layers)
    keeps = schedule_keeps(keep, retain)
    chosen = [*keeps[: len(layers) - 1], keeps[-1]]
    return tuple(Stage(layer, fraction) for layer, fraction in zip(layers, chosen, strict=True))


# -- the method ----------------------------------------------------------------------------------------------
@register_method
@dataclass(frozen=True)
class SparseVLM(Scorer):
    """Text raters' attention to the visual tokens, 3 stages (after layers 2/6/15 of 32), recycling (SparseVLM)."""

    name: ClassVar[str] = "sparsevlm"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})
    score_offset: ClassVar[int] = 1
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="compact", debias=SPARSEVLM_DEBIAS,
                                                 source="Gumpest/SparseVLMs v1.5 / main (USE_VERSION=1_0)")
    retain: int | None = None
    count: str = "preset"
    rank_scale: float = RANK_SCALE
    recycle: bool = True
    recycle_ratio: float = 0.3
    cluster_size: int = 10

    def __post_init__(self) -> None:
        if self.retain is not None and self.retain not in PRESETS:
            raise ValueError(f"retain={self.retain!r} must be one of the release's presets {sorted(PRESETS)} "
                             "(its layer-averaged token counts of 576), or None to end the schedule at keep.")
        if self.count not in COUNTS:
            raise ValueError(f"count={self.count!r}: use 'preset' (the release's fixed counts per stage) or 'rank' (the "
                             "paper's rank-adaptive count, int(rank * rank_scale); keep and retain are then unused).")
        options.number(self.rank_scale, "rank_scale", 0.0, low_open=True, hint=" (the first release: 13.5)")
        options.flag(self.recycle, "recycle")
        options.number(self.recycle_ratio, "recycle_ratio", 0.0, 1.0, hint=" (share of deleted tokens recycled; "
                       "release: 0.3)")
        options.integer(self.cluster_size, "cluster_size", 1)

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return sparsevlm_schedule(num_layers, keep, self.retain, self.count)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """The language model's input embeddings (the raters are chosen on them)."""
        return (lm_inputs.lm_input_capture(adapter),)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        index, mask = rater_queries(ctx)
        query, key = ctx.adapter.project_qk(ctx.layer, ctx.hidden, ctx.position_embeddings, index)
        device = query.device
        scaling = float(getattr(ctx.layer.self_attn, "scaling", query.shape[-1] ** -0.5))
        scores = visual_attention_scores(
            query, key, query_positions=index.to(device), key_valid=ctx.valid.to(device),
            query_valid=mask.to(device), check=False, scaling=scaling)
        if self.count == "rank":
            rows = rater_rows(query, key, index.to(device), ctx.valid, scaling)
            alive = (ctx.visual & ctx.valid).to(device)
            ctx.state[RANKS] = [rank_count(rows[b][mask[b].to(device)][:, alive[b]], int(alive[b].sum()), self.rank_scale)
                                if bool(alive[b].any()) else 0 for b in range(rows.shape[0])]
        scores = scores.to(ctx.valid.device)
        return scores if ctx.attention_filter is None else ctx.attention_filter(ctx, scores)

    def merge(self, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recycling: cluster the most relevant deleted tokens of each sample and keep the cluster means."""
        if self.count == "rank":
            kept = rank_selection(ctx, kept, scores)
        deleted = ctx.visual & ctx.valid & ~kept
        if not self.recycle or not bool(deleted.any()):
            return kept, hidden
        kept, hidden = kept.clone(), hidden.clone()
        for row in range(kept.shape[0]):
            slots = deleted[row].nonzero().flatten()
            if slots.numel() == 0:
                continue
            centres, merged = recycle_deleted(hidden[row, slots], scores[row, slots], self.recycle_ratio,
                                              self.cluster_size)
            targets = slots[centres]
            hidden[row, targets] = merged.to(hidden.dtype)
            kept[row, targets] = True
        return kept, hidden


def rank_selection(ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``kept`` with each sample's alive visual slots cut to the rank rule's count (top scores; ties: the earlier)."""
    counts = ctx.state.pop(RANKS, None)
    if counts is None:
        raise RuntimeError("sparsevlm count='rank' found no rank for this stage (score() runs before merge()).")
    alive = ctx.visual & ctx.valid
    out = kept & ~alive
    for row, count in enumerate(counts):
        slots = alive[row].nonzero().flatten()
        order = torch.sort(-scores[row, slots].float(), stable=True).indices[:count]
        out[row, slots[order]] = True
    return out


def rater_queries(ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``[B, R]`` of each sample's raters in the current layout and their mask (chosen once per call).

    The raters are stored as offsets from the end of the sample's valid slots: the text after the last visual
    token is never pruned and ends the prompt, so the offsets hold in every later layout.
    """
    table = ctx.state.get(RATERS)
    if table is None:
        table = ctx.state[RATERS] = rater_offsets(ctx)
    offsets, mask = (t.to(ctx.valid.device) for t in table)
    last, _ = ctx.last_query()
    return (last - offsets).clamp(min=0), mask


def rater_offsets(ctx: ScoreContext) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [B, R], mask [B, R])`` of the raters from each sample's last valid token; a sample without
    text after its images, or whose relevance is flat (no rater above the mean), uses all its text, or its
    last token."""
    embeds = ctx.state.pop(lm_inputs.CAPTURED, None)
    ids = ctx.inputs.get("input_ids")
    if embeds is None or ids is None:
        raise RuntimeError("sparsevlm found no language-model input embeddings / input_ids for this call "
                           "(pass input_ids, not inputs_embeds, so the raters can be chosen).")
    visual = ctx.adapter.visual_mask(ids).to(embeds.device)
    attention_mask = ctx.inputs.get("attention_mask")
    valid = torch.ones_like(visual) if attention_mask is None else attention_mask.to(embeds.device).bool()
    rows = []
    for row in range(ids.shape[0]):
        positions = torch.arange(ids.shape[1], device=embeds.device)
        seen = visual[row] & valid[row]
        last_visual = int(positions[seen].max()) if bool(seen.any()) else -1
        text = (valid[row] & ~visual[row] & (positions > last_visual)).nonzero().flatten()
        chosen = text_raters(embeds[row, seen], embeds[row, text]) if text.numel() and bool(seen.any()) else None
        if chosen is None or not bool(chosen.any()):
            chosen = torch.ones(text.numel(), dtype=torch.bool, device=embeds.device)
        rows.append((text.numel() - 1 - chosen.nonzero().flatten()).cpu() if text.numel() else torch.zeros(1).long())
    width = max(r.numel() for r in rows)
    offsets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for row, values in enumerate(rows):
        offsets[row, : values.numel()], mask[row, : values.numel()] = values, True
    return offsets, mask
