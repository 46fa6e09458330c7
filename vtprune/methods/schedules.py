"""Where each method prunes and how much: plain functions of the model depth and the final ``keep``.

Every function returns ``(Stage(layer, keep_s), ...)`` with layers increasing and keep fractions (of the
*original* visual tokens) not growing, the last one ``keep``. Layer indices of a paper's 32-layer model are
scaled to other depths with :func:`scaled_layer`.
"""

from __future__ import annotations

from vtprune.config import Stage
from vtprune.methods import budget as B

TRANSPRUNE_LAYERS = (7, 9, 12)  # of 32: prune before 0-based layers 7, 9, 12 (the paper's "after 7/9/12")
TRANSPRUNE_KEEPS = (0.875, 0.625, 0.125)
VFLOWOPT_LAYERS, VFLOWOPT_DEPTH = (9, 18), 28  # VFlowOpt's released in-LLM drops on a 28-layer LM
Ratios = tuple[float | None, float | None, float | None]


def scaled_layer(layer: int, num_layers: int, reference_layers: int = 32) -> int:
    """Scale a layer index defined for a ``reference_layers``-deep model to ``num_layers`` (at least 1)."""
    return max(1, min(num_layers - 1, round(layer * num_layers / reference_layers)))


def single_layer(num_layers: int, keep: float, layer: int = 2) -> tuple[Stage, ...]:
    """One stage before ``layer`` (FastV's K = 2), clipped to the last decoder layer."""
    return (Stage(min(layer, num_layers - 1), keep),)


def pyramid(num_layers: int, keep: float) -> tuple[Stage, ...]:
    """PyramidDrop: before layers ``L/4, L/2, 3L/4`` keep ``keep^(1/3), keep^(2/3), keep`` (duplicates merged)."""
    layers = sorted({max(1, min(num_layers - 1, round(num_layers * q / 4))) for q in (1, 2, 3)})
    fractions = [keep ** ((i + 1) / len(layers)) for i in range(len(layers))]
    return tuple(Stage(layer, fraction) for layer, fraction in zip(layers, fractions, strict=True))


def transprune(num_layers: int, keep: float) -> tuple[Stage, ...]:
    """TransPrune's three stages scaled to ``num_layers``; ``keep`` scales the dropped fractions.

    ``r_i = 1 - (1 - r_i^paper) * (1 - keep) / 0.875``, so the last stage keeps exactly ``keep``
    (``keep = 0.125`` is the paper's TransPrune-High). Stages that collide on a shallow model are merged.
    """
    keeps = [1.0 - (1.0 - r) * (1.0 - keep) / (1.0 - TRANSPRUNE_KEEPS[-1]) for r in TRANSPRUNE_KEEPS]
    keeps[-1] = keep
    stages: list[Stage] = []
    for layer, fraction in zip((scaled_layer(x, num_layers) for x in TRANSPRUNE_LAYERS), keeps, strict=True):
        layer = max(layer, stages[-1].layer + 1 if stages else 1)
        if layer <= num_layers - 1:
            stages.append(Stage(layer, fraction))
        elif stages:
            stages[-1] = Stage(stages[-1].layer, fraction)
    return tuple(stages)


def progressive(layers: tuple[int, ...], keeps: tuple[float, ...]) -> tuple[Stage, ...]:
    """Stages from explicit ``layers`` (0 = pre-LLM) and cumulative ``keeps`` (VFlowOpt's ``R1, R1 R2, ...``)."""
    return tuple(Stage(layer, keep) for layer, keep in zip(layers, keeps, strict=False))


def vflowopt(num_layers: int, keep: float, budget: float | None = None, ratios: Ratios = (None, None, None),
             layers: tuple[int, ...] | list[int] | None = None) -> tuple[Stage, ...]:
    """VFlowOpt: a pre-LLM stage keeping ``R1`` and two in-LLM stages keeping ``R1 R2``, ``R1 R2 R3``.

    With ``budget`` the stages' average retention over the decoder layers is ``budget`` (spec 4.5, ``R3``
    solved from ``R1``, ``R2``); without, the budget whose schedule ends at ``keep`` is found by bisection,
    so ``keep`` keeps its package-wide meaning (the final fraction kept). ``ratios``: given ``R1, R2, R3``
    (None: interpolated from the released configurations, ``R3`` solved).
    """
    if budget is not None:
        return vflowopt_budget(float(budget), num_layers, ratios, layers)
    low, high = 1e-4, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if vflowopt_budget(middle, num_layers, ratios, layers)[-1].keep < keep:
            low = middle
        else:
            high = middle
    stages = vflowopt_budget(high, num_layers, ratios, layers)
    last = stages[-1]
    return (*stages[:-1], Stage(last.layer, min(keep, stages[-2].keep if len(stages) > 1 else 1.0)))


def vflowopt_budget(budget: float, num_layers: int, ratios: Ratios = (None, None, None),
                    layers: tuple[int, ...] | list[int] | None = None) -> tuple[Stage, ...]:
    """VFlowOpt's stages whose average retention over the decoder layers is ``budget``."""
    r1, r2, r3 = vflowopt_ratios(budget, num_layers, ratios, layers)
    return progressive((0, *vflowopt_layers(num_layers, layers)), B.progressive_keeps(r1, r2, r3))


def vflowopt_layers(num_layers: int, layers: tuple[int, ...] | list[int] | None = None) -> tuple[int, ...]:
    """The two in-LLM stage layers (default 9 and 18 of 28, scaled), strictly increasing."""
    wanted = layers or tuple(scaled_layer(x, num_layers, VFLOWOPT_DEPTH) for x in VFLOWOPT_LAYERS)
    return tuple(sorted({min(max(1, int(x)), num_layers - 1) for x in wanted}))


def vflowopt_ratios(budget: float, num_layers: int, ratios: Ratios = (None, None, None),
                    layers: tuple[int, ...] | list[int] | None = None) -> tuple[float, float, float]:
    """``(R1, R2, R3)``: given or interpolated ``R1``/``R2``; ``R3`` given or solved for the budget."""
    default_r1, default_r2 = B.default_r1_r2(budget)
    r1 = float(ratios[0] if ratios[0] is not None else default_r1)
    r2 = float(ratios[1] if ratios[1] is not None else default_r2)
    blocks = vflowopt_blocks(num_layers, layers)
    r3 = B.solve_r3(budget, r1, r2, blocks) if ratios[2] is None else float(ratios[2])
    return r1, r2, r3


def vflowopt_blocks(num_layers: int, layers: tuple[int, ...] | list[int] | None = None) -> tuple[int, int, int]:
    """Layers before the first, between the two, and after the second in-LLM stage."""
    edges = (*vflowopt_layers(num_layers, layers), num_layers, num_layers)[:2]
    return edges[0], edges[1] - edges[0], num_layers - edges[1]
