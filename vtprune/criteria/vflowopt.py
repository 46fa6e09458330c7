"""VFlowOpt (Yang et al., ICCV 2025, arXiv:2508.05211): vision-tower importance map, recycling, progressive drops.

1. **Importance map** from the vision tower: at ViT layer ``vit_layer`` (default: the layer whose output the
   projector reads), ``relevance_i = mean_{k in K} A_ki`` over the high-receipt tokens
   ``K = {j : sum_i A_ij > t}`` (fallback: all queries), plus ``alpha * softmax_i(H_i)`` of the grey-level
   patch entropy of the de-normalised pixels (:mod:`vtprune.criteria.entropy`), mapped to the LLM's visual
   tokens (CLS dropped per the feature-select strategy; NeXT / OneVision tiles arranged by the model's own
   ``pack_image_features``, newline tokens 1.0).
2. **Stage 0** (pre-LLM, ``layer=0``): keep the top ``R1`` and **recycle** (``refine``): the pruned tokens
   plus the ``floor(N / a^2)`` least important kept ones are merged, importance-weighted, into one token per
   ``a x a`` grid cell, written into the cell's most important member. Recycling runs at the first stage
   of every image (the release recycles only anyres multi-crop images) and is skipped when the stage
   prunes nothing (``keep=1`` equals the unwrapped model).
3. **LLM stages** (default before layers 9 and 18 of 28, scaled by depth): keep ``R1 R2`` then
   ``R1 R2 R3`` of ``N0``, ranked by the same map (carried by visual ordinal in ``ctx.state``).

Budget: ``budget`` (when given; otherwise the budget whose schedule ends at ``keep``) is the **average retention** ``R̄ = (R1 L1 + R1 R2 L2 + R1 R2 R3 L3) / L``
(spec 4.5), not the final fraction; ``R3`` is solved from ``R1``, ``R2`` and clipped to ``[0.01, 1]`` unless
given (then the budget is not enforced). Default
``R1``, ``R2`` interpolate the released LLaVA-OneVision configurations. Towers: CLIP / SigLIP (LLaVA family);
Qwen-VL models are rejected at wrap time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.criteria import budget as B
from vtprune.criteria import vit
from vtprune.criteria.entropy import denormalize, entropy_weights, patch_entropy
from vtprune.criteria.functional import lowest_kept, recycle
from vtprune.methods import Method, register_method, scaled_layer
from vtprune.scoring import ScoreContext

REFERENCE_LAYERS, REFERENCE_DEPTH = (9, 18), 28
RELEASED_THRESHOLD, RELEASED_CELL, RELEASED_TOKENS, RELEASED_SIDE = 35.0, 15.58, 730, 27


@register_method
@dataclass
class VFlowOpt(Method):
    """VFlowOpt (arXiv:2508.05211): ViT relevance + entropy map, pre-LLM recycling, progressive LLM drops."""

    name: ClassVar[str] = "vflowopt"
    description: ClassVar[str] = "vision-tower importance map, pre-LLM recycling, drops at layers 9/18 of 28"
    supports_pre_llm: ClassVar[bool] = True
    budget: float | None = None
    r1: float | None = None
    r2: float | None = None
    r3: float | None = None
    vit_layer: int | None = None
    threshold: float | None = None
    alpha: float = 0.0
    cell: float | None = None
    layers: tuple[int, ...] | list[int] | None = None
    recycle: bool = True
    image_mean: list[float] | None = None
    image_std: list[float] | None = None

    def __post_init__(self) -> None:
        for name in ("budget", "r1", "r2", "r3"):
            value = getattr(self, name)
            if value is not None and not 0.0 < float(value) <= 1.0:
                raise ValueError(f"{name}={value!r} must be in (0, 1].")
        if self.cell is not None and float(self.cell) <= 0:
            raise ValueError(f"cell={self.cell!r} (grid-cell side a, in tokens) must be > 0.")

    # -- schedule ------------------------------------------------------------------------------------------
    def llm_layers(self, num_layers: int) -> tuple[int, ...]:
        """The two in-LLM stage layers (default 9 and 18 of 28, scaled), strictly increasing."""
        wanted = self.layers or tuple(scaled_layer(x, num_layers, REFERENCE_DEPTH) for x in REFERENCE_LAYERS)
        return tuple(sorted({min(max(1, int(x)), num_layers - 1) for x in wanted}))

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        """Stages for an average-retention ``budget`` if given, else ending exactly at the final ``keep``.

        ``keep`` keeps its package-wide meaning (the final fraction kept); the budget whose schedule ends
        there is found by bisection, as ``R3`` solves the paper's budget equation (Eq. 5).
        """
        if self.budget is not None:
            return self.budget_stages(float(self.budget), num_layers)
        low, high = 1e-4, 1.0
        for _ in range(40):
            middle = (low + high) / 2
            if self.budget_stages(middle, num_layers)[-1].keep < keep:
                low = middle
            else:
                high = middle
        stages = self.budget_stages(high, num_layers)
        last = stages[-1]
        return (*stages[:-1], Stage(last.layer, min(keep, stages[-2].keep if len(stages) > 1 else 1.0)))

    def budget_stages(self, budget: float, num_layers: int) -> tuple[Stage, ...]:
        """Stages whose average retention over the decoder layers is ``budget`` (spec section 4.5)."""
        r1, r2, r3 = self.ratios(budget, num_layers)
        layers = self.llm_layers(num_layers)
        keeps = B.progressive_keeps(r1, r2, r3)
        return (Stage(0, keeps[0]), *(Stage(layer, k) for layer, k in zip(layers, keeps[1:], strict=False)))

    def ratios(self, budget: float, num_layers: int) -> tuple[float, float, float]:
        """``(R1, R2, R3)``: given or interpolated ``R1``/``R2``; ``R3`` given or solved for the average retention."""
        default_r1, default_r2 = B.default_r1_r2(budget)
        r1 = float(self.r1 if self.r1 is not None else default_r1)
        r2 = float(self.r2 if self.r2 is not None else default_r2)
        r3 = B.solve_r3(budget, r1, r2, self.blocks(num_layers)) if self.r3 is None else float(self.r3)
        return r1, r2, r3

    def blocks(self, num_layers: int) -> tuple[int, int, int]:
        layers = (*self.llm_layers(num_layers), num_layers, num_layers)[:2]
        return layers[0], layers[1] - layers[0], num_layers - layers[1]

    # -- hooks ---------------------------------------------------------------------------------------------
    def prepare(self, handle: Any) -> None:
        """Hook the vision tower (its pixels) and the chosen ViT layer (its input); wrap-time checks."""
        adapter = handle.adapter
        try:
            if adapter.config.model_type not in vit.SUPPORTED_MODEL_TYPES:
                raise ValueError(
                    f"vflowopt supports {', '.join(vit.SUPPORTED_MODEL_TYPES)} (CLIP / SigLIP towers), not "
                    f"{adapter.config.model_type} (Qwen-VL's rotary, windowed ViT); use 'transprune' or 'fastv'."
                )
            layers = vit.encoder_layers(adapter)
            index = vit.feature_layer_index(adapter) if self.vit_layer is None else int(self.vit_layer)
            if not 0 <= index < len(layers):
                raise ValueError(f"vit_layer={self.vit_layer} is outside the {len(layers)}-layer vision tower; "
                                 f"use 0..{len(layers) - 1} (None: the projector's feature layer).")
        except ValueError:
            handle.remove()
            raise
        self._adapter, self._handle = adapter, handle
        self._stats = vit.pixel_statistics(adapter, self.image_mean, self.image_std)
        self._patch = int(adapter.config.vision_config.patch_size)
        tower = adapter.vision_tower
        handle.add_hook(tower.register_forward_pre_hook(handle.eager(self._grab_pixels), with_kwargs=True))
        handle.add_hook(layers[index].register_forward_pre_hook(handle.eager(self._grab_layer), with_kwargs=True))

    def _grab_pixels(self, module: Any, args: tuple, kwargs: dict) -> None:
        state = self._handle.call_state(outside=True)  # generate() runs the tower before its first forward
        if state is not None and self.alpha:
            state["vflowopt_pixels"] = args[0] if args else kwargs.get("pixel_values")

    def _grab_layer(self, module: Any, args: tuple, kwargs: dict) -> None:
        state = self._handle.call_state(outside=True)
        if state is None:
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            attention = vit.vit_attention(module, hidden)
            tokens = attention.shape[-1]
            threshold = self.threshold if self.threshold is not None else RELEASED_THRESHOLD * tokens / RELEASED_TOKENS
            crops = vit.crop_tokens(self._adapter, vit.context_relevance(attention, float(threshold)))
            pixels = state.pop("vflowopt_pixels", None)
            if self.alpha and pixels is not None:
                rgb = denormalize(pixels.reshape(-1, *pixels.shape[-3:]), *self._stats)
                weights = entropy_weights(patch_entropy(rgb, self._patch)).to(crops.device)
                crops = crops.clone()
                crops[:, -weights.shape[1]:] += self.alpha * weights
        state["vflowopt_crops"] = crops

    # -- scoring -------------------------------------------------------------------------------------------
    def importance(self, ctx: ScoreContext) -> torch.Tensor:
        """The map ``[B, N0max + 1]`` by visual ordinal (built once per call from the captured ViT layer)."""
        table = ctx.state.get("vflowopt")
        if table is None:
            crops = ctx.state.pop("vflowopt_crops", None)
            if crops is None:
                raise RuntimeError("vflowopt found no vision-tower map for this call (were images passed?).")
            counts = [int(n) for n in ctx.num_visual.tolist()]
            maps = vit.arrange(ctx.adapter, crops, ctx.inputs, counts)
            table = torch.zeros(len(counts), max(counts) + 1, device=ctx.valid.device)
            for row, (values, _) in enumerate(maps):
                table[row, : values.numel()] = values.to(table.device)
            ctx.state["vflowopt"], ctx.state["vflowopt_grids"] = table, [grids for _, grids in maps]
        return table

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        table = self.importance(ctx)
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return torch.where(ctx.ordinal >= 0, values, torch.zeros_like(values))

    def cell_side(self, ctx: ScoreContext) -> float:
        side = ctx.adapter.config.vision_config.image_size // ctx.adapter.config.vision_config.patch_size
        return float(self.cell) if self.cell is not None else RELEASED_CELL * side / RELEASED_SIDE

    def refine(self, ctx: ScoreContext, stage: Stage, keep: torch.Tensor, scores: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recycling at the first stage: merge pruned tokens per grid cell into the cell's top member."""
        alive = ctx.visual & ctx.valid
        first = not ctx.state.get("vflowopt_staged")
        ctx.state["vflowopt_staged"] = True
        if not (self.recycle and first) or bool(keep[alive].all()):
            return keep, hidden
        a = self.cell_side(ctx)
        n_merge = torch.tensor([math.floor(int(n) / (a * a)) for n in ctx.num_visual.tolist()], device=keep.device)
        cells = torch.full(ctx.ordinal.shape, -1, dtype=torch.long, device=keep.device)
        for row, segments in enumerate(ctx.state["vflowopt_grids"]):
            ids = vit.cell_ids(segments, int(ctx.num_visual[row]), a).to(keep.device)
            slots = ctx.ordinal[row] >= 0
            cells[row, slots] = ids[ctx.ordinal[row, slots]]
        demoted = lowest_kept(scores, keep & alive, n_merge)
        candidate = alive & (~keep | demoted)
        representative, hidden = recycle(hidden, scores, candidate, cells)
        return (keep & ~demoted) | representative, hidden

    # -- tuning --------------------------------------------------------------------------------------------
    def search_space(self, trial: Any, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """``R1``, ``R2`` (feasible for the budget), ``vit_layer``, ``threshold``, ``cell``, ``alpha`` (spec 4.5)."""
        low, high = self._r1_range(budget, num_layers)
        r1 = trial.suggest_float("r1", low, high)
        r2_low, r2_high = self._r2_range(budget, r1, num_layers)
        r2 = r2_low + trial.suggest_float("r2_frac", 0.0, 1.0) * (r2_high - r2_low)
        depth, tokens, side = _tower(adapter)
        return {
            "budget": budget, "r1": r1, "r2": r2,
            "vit_layer": trial.suggest_int("vit_layer", depth // 2, depth - 1),
            "threshold": trial.suggest_float("threshold", 0.0, 50.0 * tokens / RELEASED_TOKENS),
            "cell": trial.suggest_float("cell", *_cell_range(side)),
            "alpha": trial.suggest_float("alpha", -1.0, 1.0),
        }

    def search_defaults(self, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        depth, tokens, side = _tower(adapter)
        low, high = self._r1_range(budget, num_layers)
        r1, r2, _ = self.ratios(budget, num_layers)
        r1 = min(max(r1, low), high)
        r2_low, r2_high = self._r2_range(budget, r1, num_layers)
        fraction = 0.0 if r2_high <= r2_low else min(1.0, max(0.0, (r2 - r2_low) / (r2_high - r2_low)))
        layer = vit.feature_layer_index(adapter) if self.vit_layer is None else self.vit_layer
        cell = self.cell if self.cell is not None else RELEASED_CELL * side / RELEASED_SIDE
        threshold = self.threshold if self.threshold is not None else RELEASED_THRESHOLD * tokens / RELEASED_TOKENS
        low_cell, high_cell = _cell_range(side)
        return {"r1": r1, "r2_frac": fraction, "vit_layer": min(max(layer, depth // 2), depth - 1),
                "threshold": threshold, "cell": min(max(cell, low_cell), high_cell), "alpha": self.alpha}

    def _r1_range(self, budget: float, num_layers: int) -> tuple[float, float]:
        l1, l2, l3 = self.blocks(num_layers)
        cap = budget * num_layers / (l1 + B.MIN_KEEP * (l2 + l3)) if l1 else 1.0
        high = min(1.0, 1.5 * budget, cap)
        return min(budget, high), high

    def _r2_range(self, budget: float, r1: float, num_layers: int) -> tuple[float, float]:
        l1, l2, l3 = self.blocks(num_layers)
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
