"""Compute budgets of pruning schedules: average retention over the decoder layers (VFlowOpt Eq. 5).

``average_retention(stages, L) = sum_l r(l) / L`` where ``r(l)`` is the fraction of the original visual
tokens that decoder layer ``l`` sees (1 before the first stage). It is the budget ``vtprune tune`` holds
every method to, so a single-stage method (FastV) and a progressive one (PyramidDrop, TransPrune,
VFlowOpt) are compared at equal visual-token compute in the language model.
"""

from __future__ import annotations

from collections.abc import Callable

from vtprune.config import Stage

MIN_KEEP = 0.01


def average_retention(stages: tuple[Stage, ...] | list[Stage], num_layers: int) -> float:
    """Mean over the ``num_layers`` decoder layers of the visual fraction each layer sees."""
    total, keep, previous = 0.0, 1.0, 0
    for stage in sorted(stages, key=lambda s: s.layer):
        total += keep * (stage.layer - previous)
        keep, previous = stage.keep, stage.layer
    total += keep * (num_layers - previous)
    return total / num_layers


def solve_keep(stages_for: Callable[[float], tuple[Stage, ...]], budget: float, num_layers: int,
               min_keep: float = MIN_KEEP, iterations: int = 50) -> float | None:
    """The final ``keep`` whose schedule ``stages_for(keep)`` has average retention ``budget`` (bisection).

    Assumes retention grows with ``keep``. Returns None when even ``min_keep`` exceeds the budget
    (infeasible); returns 1.0 when keeping everything stays within it.
    """
    if average_retention(stages_for(1.0), num_layers) <= budget:
        return 1.0
    if average_retention(stages_for(min_keep), num_layers) > budget + 1e-9:
        return None
    low, high = min_keep, 1.0
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        if average_retention(stages_for(middle), num_layers) > budget:
            high = middle
        else:
            low = middle
    return low


def schedule_string(stages: tuple[Stage, ...]) -> str:
    """``"2:0.25,8:0.1"`` for ``stages`` (keeps rounded to 6 digits)."""
    return ",".join(f"{s.layer}:{round(s.keep, 6):g}" for s in stages)


def progressive_keeps(r1: float, r2: float, r3: float) -> tuple[float, float, float]:
    """Keep fractions of the original tokens for relative stage keeps ``R1, R2, R3`` (VFlowOpt)."""
    return r1, r1 * r2, r1 * r2 * r3


def solve_r3(budget: float, r1: float, r2: float, blocks: tuple[int, int, int]) -> float:
    """VFlowOpt's ``R3`` from ``R̄ = (R1 L1 + R1 R2 L2 + R1 R2 R3 L3) / L``, clipped to ``[MIN_KEEP, 1]``.

    blocks: ``(L1, L2, L3)``, the number of decoder layers after each of the three stages.
    """
    l1, l2, l3 = blocks
    total = l1 + l2 + l3
    if l3 == 0 or r1 * r2 == 0:
        return 1.0
    r3 = (budget * total - r1 * l1 - r1 * r2 * l2) / (r1 * r2 * l3)
    return float(min(1.0, max(MIN_KEEP, r3)))


# Released VFlowOpt LLaVA-OneVision-7B configurations (spec 4.5): (budget, R1, R2).
RELEASED_VFLOWOPT = ((0.0, 0.0, 1.0), (0.10, 0.1166, 1.0), (0.25, 0.2651, 0.9833), (0.50, 0.7233, 0.7487),
                     (1.0, 1.0, 1.0))


def default_r1_r2(budget: float) -> tuple[float, float]:
    """``(R1, R2)`` interpolated linearly in the budget between the released configurations."""
    points = RELEASED_VFLOWOPT
    for (b0, a0, c0), (b1, a1, c1) in zip(points, points[1:], strict=False):
        if b0 <= budget <= b1:
            t = (budget - b0) / (b1 - b0)
            return max(budget, a0 + t * (a1 - a0)), c0 + t * (c1 - c0)
    return 1.0, 1.0


class InfeasibleBudget(ValueError):
    """The schedule cannot reach the average-retention budget (its unpruned layers alone exceed it)."""


def feasible_single_layers(budget: float, num_layers: int, min_keep: float = MIN_KEEP) -> list[int]:
    """First-stage layers ``K >= 1`` whose retention ``(K + (L - K) * min_keep) / L`` can meet ``budget``."""
    layers = [k for k in range(1, num_layers) if (k + (num_layers - k) * min_keep) / num_layers <= budget + 1e-9]
    if not layers:
        raise InfeasibleBudget(
            f"an average retention of {budget} is below what pruning inside the {num_layers}-layer language model "
            f"can reach (layer 0 always sees every token: at least {(1 + (num_layers - 1) * min_keep) / num_layers:.3f}); "
            "raise --budget or use a method with a pre-LLM stage (vflowopt)."
        )
    return layers


def budget_schedule(stages_for: Callable[[float], tuple[Stage, ...]], budget: float, num_layers: int) -> str:
    """The schedule string of ``stages_for(keep)`` with ``keep`` solved for ``budget``; raises InfeasibleBudget."""
    keep = solve_keep(stages_for, budget, num_layers)
    if keep is None:
        lowest = average_retention(stages_for(MIN_KEEP), num_layers)
        raise InfeasibleBudget(
            f"schedule {schedule_string(stages_for(MIN_KEEP))} cannot reach an average retention of {budget} on "
            f"{num_layers} layers (lowest: {lowest:.3f}); raise the budget or choose earlier stage layers."
        )
    return schedule_string(stages_for(keep))
