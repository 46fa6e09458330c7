"""The frozen plan of a wrapped model: the scorer and its stages, checked once at wrap time, and the
:class:`Wiring` the engine's parts read (the plan with its adapter).

``keep`` flows one way: :class:`~vtprune.config.PruneConfig` -> :func:`make_plan` (the stages, or a KV
retention's budget) -> :meth:`Plan.count` (per stage and sample, the one rounding rule
:func:`~vtprune.config.keep_count`, or under ``parity="release"`` the method's released rule; a group's quota
comes from it through ``ScoreContext.kept_count``; under ``rounding="per_image"`` a sample's count is the sum of its
images' and frames' counts, :meth:`Plan.kept_counts`) -> the engine (counts computed on the device, no copy) ->
``segmented_topk`` -> the layout. Nothing after the plan reads ``PruneConfig.keep``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vtprune.adapters.base import Adapter, VisualSegment
from vtprune.config import PruneConfig, Stage, keep_count, truncated_count, validate_stages
from vtprune.kernels import check_environment as check_kernel_environment
from vtprune.methods import release
from vtprune.methods.base import KVRetention, Scorer
from vtprune.methods.per_frame import frame_ids
from vtprune.methods.prefixkv import profile_ratios, read_profile

PRE_LLM_BLOCKERS = frozenset({"attention", "llm_layers"})
#: Methods that spend one budget over a whole video (refused with ``rounding="per_image"``).
PER_ITEM_METHODS = frozenset({"temporal"})


@dataclass(frozen=True)
class KVPlan:
    """KV retention of a plan: the scorer's :class:`~vtprune.methods.base.KVRetention`, the budget ``keep`` (the
    share of the evictable entries the layers keep, on average over the layers) and the per-layer eviction
    ``ratios`` of the retention's profile at that budget (None: the counts are searched per call)."""

    retention: KVRetention
    keep: float
    ratios: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Plan:
    """What a wrapped model does at every prefill: ``scorer`` ranks the visual tokens at each of ``stages``, or,
    with ``kv`` (KV retention), gives every layer's cache its own kept entries."""

    scorer: Scorer
    stages: tuple[Stage, ...]
    positions: str = "original"
    counting: str = "round"
    kv: KVPlan | None = None
    rounding: str = "sample"

    def count(self, keep: float, n: int) -> int:
        """Visual tokens kept of ``n`` at fraction ``keep``: ``keep_count`` (``counting="round"``) or
        ``truncated_count`` (``"truncate"``, a release's ``int(n * keep)``). A group's quota uses it too."""
        return truncated_count(keep, n) if self.counting == "truncate" else keep_count(keep, n)

    def kept_counts(self, visual_counts: list[int], groups: list[list[int]] | None = None) -> list[list[int]]:
        """``[stage][sample]`` visual tokens kept of each sample's ``n`` (:meth:`count`).

        Under ``rounding="per_image"`` a sample keeps ``sum_g count(keep, n_g)`` over ``groups[sample]``, the sizes
        of its images and video frames (:func:`group_sizes`), as the vLLM plugin counts each item before the tower.
        """
        if self.rounding == "sample":
            return [[self.count(stage.keep, n) for n in visual_counts] for stage in self.stages]
        if groups is None or len(groups) != len(visual_counts):
            raise RuntimeError("rounding='per_image' needs the image / frame sizes of every sample (group_sizes).")
        return [[sum(self.count(stage.keep, g) for g in sizes) for sizes in groups] for stage in self.stages]

    def device_kept_counts(self, num_visual: torch.Tensor, planned: list[list[int]] | None = None) -> torch.Tensor:
        """``[stages, B]``: :meth:`kept_counts` computed on the device of ``num_visual`` ``[B]`` (no copy from the
        host); ``num_visual[None]`` for a plan without stages. Under ``rounding="per_image"`` the host counts
        ``planned`` (``[stages][B]``, from :meth:`kept_counts`) are copied there (one small copy per call)."""
        if self.rounding == "per_image" and self.stages:
            return torch.tensor(planned, dtype=torch.long).to(num_visual.device, non_blocking=True)
        return device_kept_counts(num_visual, [s.keep for s in self.stages], self.counting)

    @property
    def llm_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if s.layer > 0)

    def score_layers(self, num_layers: int) -> set[int]:
        """Decoder layers whose input is scored (a stage at layer K scores layer ``K - score_offset``; every
        layer under KV retention)."""
        if self.kv is not None:
            return set(range(num_layers))
        return {self.scorer.score_layer(s) for s in self.llm_stages}

    def first_pruned_layer(self) -> int | None:
        """The first decoder layer that sees a pruned sequence or cache (0 under KV retention), or None."""
        return 0 if self.kv is not None else min((s.layer for s in self.llm_stages), default=None)

    def regions(self, num_layers: int) -> list[int]:
        """For each decoder layer, its decode region: how many in-LM stages it follows (0: it sees the whole
        prompt); under KV retention every layer is its own region (``layer + 1``)."""
        if self.kv is not None:
            return [i + 1 for i in range(num_layers)]
        return [sum(1 for s in self.llm_stages if s.layer <= i) for i in range(num_layers)]


@dataclass(frozen=True)
class Wiring:
    """What the engine's parts (:mod:`vtprune.prefill`, :mod:`vtprune.decode`, :mod:`vtprune.kv`) read of one
    wrapped model, beside the call's own state: its ``plan``, its ``adapter`` and the ``observers`` of its stages
    (the handle's list, which ``PruneHandle.observe`` extends). Built once at wrap time; the parts never see the
    handle. ``region_of_layer``: each decoder layer's decode region (:meth:`Plan.regions`)."""

    plan: Plan
    adapter: Adapter
    observers: list[Callable[[Any], None]] = field(default_factory=list)
    region_of_layer: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "region_of_layer", tuple(self.plan.regions(self.adapter.num_layers)))

    @property
    def scorer(self) -> Scorer:
        return self.plan.scorer

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.plan.stages


def device_kept_counts(num_visual: torch.Tensor, keeps: list[float], counting: str = "round") -> torch.Tensor:
    """``[stages, B]`` kept counts computed on ``num_visual``'s device, equal to the host rules of
    :func:`vtprune.config.keep_count` (``"round"``: ``floor(keep n + 0.5)``) and
    :func:`vtprune.config.truncated_count` (``"truncate"``: ``int(n keep)``), both at least 1 and at most ``n``
    (0 for ``n = 0``). float64 arithmetic, as Python's; no host-to-device copy."""
    n = num_visual.double()
    rows = []
    for keep in keeps:
        raw = torch.floor(keep * n + 0.5) if counting == "round" else torch.floor(n * keep)
        rows.append(torch.minimum(torch.clamp(raw, min=1), n))
    return torch.stack(rows).long() if rows else num_visual[None].long()


def group_sizes(segments: list[VisualSegment], total: int) -> list[int]:
    """Visual tokens of each image and video frame (temporal patch) of one sample of ``total`` visual tokens,
    the groups of :func:`vtprune.methods.per_frame.frame_ids` (empty for a sample without visual tokens)."""
    if total <= 0:
        return []
    return [int(n) for n in torch.bincount(frame_ids(segments, total)).tolist() if n > 0]


def check_rounding(config: PruneConfig, scorer: Scorer) -> str:
    """``config.rounding``, refused where a per-image count has no meaning for the method (one line)."""
    rounding = getattr(config, "rounding", "sample")
    if rounding == "per_image" and scorer.kv_retention() is not None:
        raise ValueError(f"rounding='per_image' counts kept visual tokens per image; method {scorer.name!r} evicts "
                         "cache entries instead (keep= is its average cache budget); drop rounding=.")
    if rounding == "per_image" and scorer.name in PER_ITEM_METHODS:
        raise ValueError(f"rounding='per_image' counts each frame's tokens, but method {scorer.name!r} spends one "
                         "budget over a whole video (as the vLLM plugin does); drop rounding= for it.")
    return rounding


def make_plan(config: PruneConfig, scorer: Scorer, adapter: Adapter) -> Plan:
    """The plan of ``config`` for ``adapter``'s model: explicit stages or the scorer's schedule, all checked."""
    missing = sorted(scorer.requires - adapter.capabilities)
    if missing:
        raise ValueError(
            f"method {scorer.name!r} needs {', '.join(missing)}, which {adapter.config.model_type} does not offer "
            f"(it offers {', '.join(sorted(adapter.capabilities))}); use a method such as 'fastv' or 'transprune'."
        )
    check_kernel_environment(_device(adapter))
    rounding = check_rounding(config, scorer)
    positions, counting = config.positions, "round"
    if getattr(config, "parity", "default") == "release":  # the method's released count, positions, debias
        scorer, rule = release.for_release(scorer, adapter, config.positions)
        positions, counting = rule.positions, rule.count
    stages = config.stages if config.stages is not None else scorer.schedule(adapter.num_layers, config.keep)
    if stages:
        check_stages(tuple(stages), adapter, scorer, config)
    if positions == "compact" and "compact_positions" not in adapter.capabilities:
        raise ValueError(
            f"positions='compact' is not supported for {adapter.config.model_type} (3-D M-RoPE positions); "
            "use positions='original'."
        )
    retention = scorer.kv_retention()
    if retention is not None and config.stages is not None:
        raise ValueError(
            f"method {scorer.name!r} keeps every token and evicts cache entries at every layer: it takes no "
            f"schedule (got {config.stages!r}); drop schedule= and set keep= (the average share of visual keys kept).")
    kv = None if retention is None else kv_plan(retention, adapter, config.keep)
    return Plan(scorer=scorer, stages=tuple(stages), positions=positions, counting=counting, kv=kv, rounding=rounding)


def kv_plan(retention: KVRetention, adapter: Adapter, keep: float) -> KVPlan:
    """The KV retention of a plan at budget ``keep``: the profile's per-layer ratios read (and checked against the
    model) once, at wrap time."""
    if retention.profile is None:
        return KVPlan(retention=retention, keep=keep)
    budgets = read_profile(retention.profile, adapter.config.model_type, adapter.num_layers, retention.scope)
    ratios = profile_ratios(budgets, keep, f"profile {retention.profile!r}")
    return KVPlan(retention=retention, keep=keep, ratios=tuple(ratios))


def _device(adapter: Adapter) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    parameter = next(iter(adapter.model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def check_stages(stages: tuple[Stage, ...], adapter: Adapter, scorer: Scorer, config: PruneConfig) -> None:
    """Layers inside the model and increasing, keeps not growing, each stage scorable where the scorer reads."""
    validate_stages(stages, adapter.num_layers)
    first_allowed = adapter.min_prune_layer()
    inside = [stage.layer for stage in stages if 0 < stage.layer < first_allowed]
    if inside:
        raise ValueError(
            f"{adapter.config.model_type} cannot prune at layer {inside[0]}: DeepStack features are still added to "
            f"the visual tokens there; give a schedule whose stages are at layers >= {first_allowed} (e.g. "
            f"schedule='{first_allowed}:0.5'), or at layer 0 for a pre-LLM method (DeepStack rows dropped with their tokens)."
        )
    if stages[0].layer == 0 and scorer.requires & PRE_LLM_BLOCKERS:
        raise ValueError(
            f"method {config.method!r} scores with language-model attention and cannot prune before the "
            "first decoder layer (layer 0); use a layer >= 1, e.g. schedule='2:0.25'."
        )
    for previous, stage in zip((None, *stages[:-1]), stages):
        score_layer = scorer.score_layer(stage)
        lowest = 0 if previous is None else previous.layer
        if stage.layer > 0 and score_layer < lowest:
            raise ValueError(
                f"method {config.method!r} scores the stage at layer {stage.layer} at layer {score_layer}, before "
                f"the previous stage at layer {lowest}; space the stages at least {scorer.score_offset} layer(s) apart."
            )
