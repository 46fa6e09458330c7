"""The search space of each method for ``vtprune tune`` (optuna), under an average-retention budget.

``space(method, scorer, trial, budget, num_layers, adapter) -> wrap() options`` and ``defaults(...) -> optuna
params`` of the method's default configuration (enqueued as trial 0). Methods without an entry tune nothing:
their default schedule's final keep is solved for the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vtprune.config import Stage
from vtprune.methods import budget as B
from vtprune.methods import schedules, vit
from vtprune.methods.base import Scorer
from vtprune.methods.vflowopt import RELEASED_CELL, RELEASED_SIDE, RELEASED_THRESHOLD, RELEASED_TOKENS

Space = Callable[[Scorer, Any, float, int, Any], dict[str, Any]]


def _default_space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    return {"schedule": B.budget_schedule(lambda keep: scorer.schedule(num_layers, keep), budget, num_layers)}


def _fastv_space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """The pruning layer K; the keep fraction follows from the budget."""
    layers = B.feasible_single_layers(budget, num_layers)
    layer = trial.suggest_int("layer", layers[0], layers[-1])
    return {"schedule": B.budget_schedule(lambda keep: (Stage(layer, keep),), budget, num_layers)}


def _fastv_defaults(scorer: Scorer, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    layers = B.feasible_single_layers(budget, num_layers)
    return {"layer": min(max(scorer.schedule(num_layers, 1.0)[0].layer, layers[0]), layers[-1])}


def _pdrop_space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """The (up to 3) stage layers; the keeps ``keep^(i/n)`` follow from the budget."""
    first = trial.suggest_int("layer1", 1, B.feasible_single_layers(budget, num_layers)[-1])
    others = [trial.suggest_int(f"layer{i}", 1, num_layers - 1) for i in (2, 3)]
    layers = sorted({first, *others})

    def stages(keep: float) -> tuple[Stage, ...]:
        return tuple(Stage(layer, keep ** ((i + 1) / len(layers))) for i, layer in enumerate(layers))

    return {"schedule": B.budget_schedule(stages, budget, num_layers)}


def _pdrop_defaults(scorer: Scorer, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    layers = [s.layer for s in scorer.schedule(num_layers, 0.5)]
    layers += [layers[-1]] * (3 - len(layers))
    return {"layer1": min(layers[0], B.feasible_single_layers(budget, num_layers)[-1]),
            "layer2": layers[1], "layer3": layers[2]}


def _transprune_space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """``alpha``; the final keep of the default schedule follows from the budget."""
    return {"alpha": trial.suggest_float("alpha", 0.0, 1.0), **_default_space(scorer, trial, budget, num_layers, adapter)}


def _vflowopt_space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """``R1``, ``R2`` (feasible for the budget), ``vit_layer``, ``threshold``, ``cell``, ``alpha`` (spec 4.5)."""
    low, high = _r1_range(budget, num_layers, scorer.layers)
    r1 = trial.suggest_float("r1", low, high)
    r2_low, r2_high = _r2_range(budget, r1, num_layers, scorer.layers)
    r2 = r2_low + trial.suggest_float("r2_frac", 0.0, 1.0) * (r2_high - r2_low)
    depth, tokens, side = _tower(adapter)
    return {
        "budget": budget, "r1": r1, "r2": r2,
        "vit_layer": trial.suggest_int("vit_layer", depth // 2, depth - 1),
        "threshold": trial.suggest_float("threshold", 0.0, 50.0 * tokens / RELEASED_TOKENS),
        "cell": trial.suggest_float("cell", *_cell_range(side)),
        "alpha": trial.suggest_float("alpha", -1.0, 1.0),
    }


def _vflowopt_defaults(scorer: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    depth, tokens, side = _tower(adapter)
    low, high = _r1_range(budget, num_layers, scorer.layers)
    r1, r2, _ = schedules.vflowopt_ratios(budget, num_layers, (scorer.r1, scorer.r2, scorer.r3), scorer.layers)
    r1 = min(max(r1, low), high)
    r2_low, r2_high = _r2_range(budget, r1, num_layers, scorer.layers)
    fraction = 0.0 if r2_high <= r2_low else min(1.0, max(0.0, (r2 - r2_low) / (r2_high - r2_low)))
    layer = vit.feature_layer_index(adapter) if scorer.vit_layer is None else scorer.vit_layer
    cell = scorer.cell if scorer.cell is not None else RELEASED_CELL * side / RELEASED_SIDE
    threshold = scorer.threshold if scorer.threshold is not None else RELEASED_THRESHOLD * tokens / RELEASED_TOKENS
    low_cell, high_cell = _cell_range(side)
    return {"r1": r1, "r2_frac": fraction, "vit_layer": min(max(layer, depth // 2), depth - 1),
            "threshold": threshold, "cell": min(max(cell, low_cell), high_cell), "alpha": scorer.alpha}


def _r1_range(budget: float, num_layers: int, layers: Any) -> tuple[float, float]:
    l1, l2, l3 = schedules.vflowopt_blocks(num_layers, layers)
    cap = budget * num_layers / (l1 + B.MIN_KEEP * (l2 + l3)) if l1 else 1.0
    high = min(1.0, 1.5 * budget, cap)
    return min(budget, high), high


def _r2_range(budget: float, r1: float, num_layers: int, layers: Any) -> tuple[float, float]:
    l1, l2, l3 = schedules.vflowopt_blocks(num_layers, layers)
    spare = budget * num_layers - r1 * l1
    low = min(1.0, max(B.MIN_KEEP, spare / (r1 * (l2 + l3)))) if l2 + l3 else 1.0
    high = min(1.0, spare / (r1 * (l2 + B.MIN_KEEP * l3))) if l2 else 1.0
    return low, max(low, high)


def _tower(adapter: Any) -> tuple[int, int, int]:
    """(ViT depth, tokens per crop, grid side) of ``adapter``'s vision tower."""
    vision = adapter.config.vision_config
    side = int(vision.image_size // vision.patch_size)
    return int(vision.num_hidden_layers), side * side + 1, side


def _cell_range(side: int) -> tuple[float, float]:
    """Search range of the cell side ``a``: the released ``[3, 24]`` on a 27-token grid, scaled, at least 2.

    Below 2 most cells hold one token, every pruned token comes back as its own "merge" and stage 0
    keeps far more than ``R1 N``.
    """
    low = max(2.0, 3.0 * side / RELEASED_SIDE)
    return low, max(low + 0.5, 24.0 * side / RELEASED_SIDE)


SPACES: dict[str, tuple[Space, Callable[..., dict[str, Any]]]] = {
    "fastv": (_fastv_space, _fastv_defaults),
    "pdrop": (_pdrop_space, _pdrop_defaults),
    "transprune": (_transprune_space, lambda scorer, *_: {"alpha": scorer.alpha}),
    "vflowopt": (_vflowopt_space, _vflowopt_defaults),
}


def space(scorer: Scorer, trial: Any, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """``wrap()`` options of one optuna ``trial`` whose average retention is ``budget``."""
    search = SPACES.get(_base_name(scorer), (_default_space, None))[0]
    return search(scorer, trial, budget, num_layers, adapter)


def defaults(scorer: Scorer, budget: float, num_layers: int, adapter: Any) -> dict[str, Any]:
    """The optuna parameters of the method's default configuration (trial 0)."""
    entry = SPACES.get(_base_name(scorer))
    return entry[1](scorer, budget, num_layers, adapter) if entry else {}


def _base_name(scorer: Scorer) -> str:
    return scorer.inner.name if hasattr(scorer, "inner") and hasattr(scorer, "debiaser") else scorer.name
