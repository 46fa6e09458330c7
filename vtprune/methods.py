"""Pruning methods: a criterion (how visual tokens are scored) plus its default schedule.

A method scores visual tokens from a :class:`~vtprune.scoring.ScoreContext`; the engine keeps the top
``keep_count(stage.keep, N0)`` visual tokens of every sample. Baselines live here; the criteria of
later papers register themselves with :func:`register_method` in their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.scoring import ScoreContext

METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to the registry under ``cls.name``."""
    METHODS[cls.name] = cls
    return cls


def load_method_config(path: str) -> dict[str, Any]:
    """Options saved by ``vtprune tune`` (a JSON object of :func:`vtprune.wrap` keyword arguments), validated.

    Wrong types, non-finite numbers, bad keep fractions / schedules and options the file's method does not
    take raise :class:`vtprune.errors.UserError` naming the file and the field, at load time. The file's
    ``method`` is not among the returned options: :func:`vtprune.method_config.read_method_config` gives it.
    """
    from vtprune.method_config import read_method_config

    return read_method_config(path).options


def list_methods() -> list[str]:
    """Names accepted by ``vtprune.wrap(model, method=...)``."""
    _load_criteria()
    return sorted(METHODS)


def make_method(name: str, options: dict[str, Any] | None = None) -> Method:
    """Instantiate a method by name; unknown names raise ``ValueError`` listing the known ones."""
    _load_criteria()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}.")
    cls = METHODS[name]
    options = dict(options or {})
    if "debias" in options and "debias" not in getattr(cls, "__dataclass_fields__", {}):
        if options.pop("debias"):
            debiasable = sorted(n for n, c in METHODS.items() if "debias" in getattr(c, "__dataclass_fields__", {}))
            raise ValueError(
                f"method {name!r} does not score with language-model attention, so debias does not apply to it; "
                f"drop debias / '+debias', or use one of: {', '.join(debiasable)}."
            )
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options {options!r} for method {name!r}: {err}") from err


def _load_criteria() -> None:
    """Import the modules whose methods register themselves (kept lazy: nothing happens at import)."""
    import importlib

    for module in ("vtprune.criteria", "vtprune.frame_budget"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def scaled_layer(layer: int, num_layers: int, reference_layers: int = 32) -> int:
    """Scale a layer index defined for a ``reference_layers``-deep model to ``num_layers`` (at least 1)."""
    return max(1, min(num_layers - 1, round(layer * num_layers / reference_layers)))


@dataclass
class Method:
    """Base class. Subclasses set ``name`` and implement :meth:`score`.

    ``needs`` names what the method requires from the adapter (``"attention"``); ``query`` is which
    text tokens' attention it reads. ``score_offset`` is how many layers before the pruning layer the
    scores are taken (FastV: 1, the layer before; PyramidDrop: 0, the pruning layer's own q/k).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs: ClassVar[frozenset[str]] = frozenset()
    supports_pre_llm: ClassVar[bool] = True
    score_offset: ClassVar[int] = 0

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(min(2, num_layers - 1), keep),)

    def score_layer(self, stage: Stage) -> int:
        """The decoder layer whose input is scored for ``stage`` (``<= stage.layer``)."""
        return stage.layer - self.score_offset

    def prepare(self, handle: Any) -> None:
        """Called once at wrap time; register extra hooks with ``handle.add_hook`` if needed."""

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        """Scores ``[B, L]`` for the current slots; only alive visual slots are ranked (higher is kept)."""
        raise NotImplementedError

    def search_space(self, trial: Any, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """``wrap()`` options of one optuna ``trial`` whose average retention is ``budget`` (``vtprune tune``).

        Default: nothing to tune; the default schedule's final keep is solved for the budget.
        """
        from vtprune.criteria.budget import budget_schedule

        return {"schedule": budget_schedule(lambda keep: self.default_stages(num_layers, keep), budget, num_layers)}

    def search_defaults(self, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """The optuna parameters of the default configuration (enqueued as the first trial)."""
        return {}

    def refine(self, ctx: ScoreContext, stage: Stage, keep: torch.Tensor, scores: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Optionally change the keep mask ``[B, L]`` and the hidden states ``[B, L, D]`` before slicing.

        Merging methods write merged tokens into kept slots here (e.g. VFlowOpt recycling). Default: as is.
        """
        return keep, hidden


@register_method
@dataclass
class NoPruning(Method):
    """Keep every token (the unpruned reference through the same hooks)."""

    name: ClassVar[str] = "none"
    description: ClassVar[str] = "no pruning (reference)"

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return ()

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        return torch.zeros(ctx.valid.shape, device=ctx.valid.device)


@register_method
@dataclass
class RandomPruning(Method):
    """Keep a seeded uniformly random subset; the same sample gets the same subset alone or in a batch."""

    name: ClassVar[str] = "random"
    description: ClassVar[str] = "seeded random subset (baseline)"
    seed: int = 0

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1000 + stage.layer)
        largest = max(ctx.visual_counts, default=0)
        table = torch.rand(largest + 1, generator=generator).to(ctx.valid.device)
        return torch.where(ctx.ordinal >= 0, table[ctx.ordinal.clamp(min=0)], torch.zeros_like(table[:1]))


@register_method
@dataclass
class FastV(Method):
    """FastV (Chen et al., ECCV 2024, arXiv:2403.06764).

    The head-averaged attention the last prompt token pays to each visual token in layer ``K-1``
    ranks the tokens; the bottom ones are dropped before layer ``K`` (default ``K=2``).
    """

    name: ClassVar[str] = "fastv"
    description: ClassVar[str] = "last-token attention at layer K-1, prune at K (default K=2)"
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    supports_pre_llm: ClassVar[bool] = False
    score_offset: ClassVar[int] = 1
    debias: bool | str = False

    def __post_init__(self) -> None:
        self.debias = _check_debias(self.debias)

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(min(2, num_layers - 1), keep),)

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        return _debias(self, ctx, ctx.attention("last"))

    def search_space(self, trial: Any, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """Tunes the pruning layer K; the keep fraction follows from the average-retention ``budget``."""
        from vtprune.criteria.budget import budget_schedule, feasible_single_layers

        layers = feasible_single_layers(budget, num_layers)
        layer = trial.suggest_int("layer", layers[0], layers[-1])
        return {"schedule": budget_schedule(lambda keep: (Stage(layer, keep),), budget, num_layers)}

    def search_defaults(self, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        from vtprune.criteria.budget import feasible_single_layers

        layers = feasible_single_layers(budget, num_layers)
        return {"layer": min(max(self.default_stages(num_layers, 1.0)[0].layer, layers[0]), layers[-1])}


@register_method
@dataclass
class PyramidDrop(Method):
    """PyramidDrop (Xing et al., CVPR 2025, arXiv:2410.17247).

    Progressive: before layers ``L/4, L/2, 3L/4`` keep ``keep^(1/3), keep^(2/3), keep`` of the visual
    tokens, each stage ranked by the last instruction token's attention recomputed with that layer's q/k.
    """

    name: ClassVar[str] = "pdrop"
    description: ClassVar[str] = "progressive, last-instruction-token attention at each stage"
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    supports_pre_llm: ClassVar[bool] = False
    debias: bool | str = False

    def __post_init__(self) -> None:
        self.debias = _check_debias(self.debias)

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        layers = sorted({max(1, min(num_layers - 1, round(num_layers * q / 4))) for q in (1, 2, 3)})
        fractions = [keep ** ((i + 1) / len(layers)) for i in range(len(layers))]
        return tuple(Stage(layer, fraction) for layer, fraction in zip(layers, fractions, strict=True))

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        return _debias(self, ctx, ctx.attention("last"))

    def search_space(self, trial: Any, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """Tunes the (up to 3) stage layers; the keeps ``keep^(i/n)`` follow from the budget."""
        from vtprune.criteria.budget import budget_schedule, feasible_single_layers

        first = trial.suggest_int("layer1", 1, feasible_single_layers(budget, num_layers)[-1])
        others = [trial.suggest_int(f"layer{i}", 1, num_layers - 1) for i in (2, 3)]
        layers = sorted({first, *others})

        def stages(keep: float) -> tuple[Stage, ...]:
            return tuple(Stage(layer, keep ** ((i + 1) / len(layers))) for i, layer in enumerate(layers))

        return {"schedule": budget_schedule(stages, budget, num_layers)}

    def search_defaults(self, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        from vtprune.criteria.budget import feasible_single_layers

        layers = [s.layer for s in self.default_stages(num_layers, 0.5)]
        layers += [layers[-1]] * (3 - len(layers))
        return {"layer1": min(layers[0], feasible_single_layers(budget, num_layers)[-1]),
                "layer2": layers[1], "layer3": layers[2]}


def _check_debias(value: Any) -> bool | str:
    from vtprune.criteria.debias import check_debias_option

    return check_debias_option(value)


def _debias(method: Method, ctx: ScoreContext, scores: torch.Tensor) -> torch.Tensor:
    """Apply attention debiasing (arXiv:2508.17807) when ``method.debias`` is set."""
    if not getattr(method, "debias", False):
        return scores
    from vtprune.criteria.debias import apply_debias

    return apply_debias(method, ctx, scores)


@register_method
@dataclass
class Oracle(Method):
    """Keeps the evidence tokens first (benchmark reference line; needs ``handle.set_evidence``)."""

    name: ClassVar[str] = "oracle"
    description: ClassVar[str] = "evidence tokens first (benchmark upper reference)"
    evidence: list = field(default_factory=list)

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        evidence = ctx.inputs.get("vtprune_evidence")
        if evidence is None:
            raise ValueError("method 'oracle' needs the evidence of each sample: call handle.set_evidence([...]).")
        scores = torch.zeros(ctx.valid.shape, device=ctx.valid.device)
        for row, values in enumerate(evidence):
            values = torch.as_tensor(values, dtype=torch.float32, device=scores.device)
            alive = ctx.ordinal[row] >= 0
            # Evidence first; among equals, earlier tokens win through the selection's tie rule.
            scores[row, alive] = values[ctx.ordinal[row, alive]]
        return scores
