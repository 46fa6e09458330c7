"""VFlowOpt (Yang et al., ICCV 2025, arXiv:2508.05211): vision-tower importance map, recycling, progressive drops.

1. **Importance map** from the vision tower: at ViT layer ``vit_layer`` (default: the layer whose output the
   projector reads), ``relevance_i = mean_{k in K} A_ki`` over the high-receipt tokens
   ``K = {j : sum_i A_ij > t}`` (fallback: all queries), plus ``alpha * softmax_i(H_i)`` of the grey-level
   patch entropy of the de-normalised pixels (:mod:`vtprune.methods.entropy`), mapped to the LLM's visual
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
``R1``, ``R2`` interpolate the released LLaVA-OneVision configurations.

Towers (adapter capability ``"vit_attention"``): CLIP / SigLIP (LLaVA family) and the Qwen-VL ViT
(:mod:`vtprune.methods.qwen_vit`: the last full-attention block, recomputed with its 2-D rotary embedding,
averaged over each 2x2 merge group; VFlowOpt's Table 3 runs Qwen2-VL-7B). On Qwen the recycling cells are in
merged-token units, ``a = 15.58 sqrt(h w) / 27`` per image (the release's cell-to-side ratio on each image's
``h x w`` merged grid). Qwen3-VL adds DeepStack features after its first LM layers, so it cannot prune before
the LM (``layer=0``): give a schedule from layer ``len(deepstack_visual_indexes)`` on (recycling then merges
that layer's hidden states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage, stage_layer
from vtprune.methods import options, qwen_vit, schedules, vit
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.entropy import denormalize, entropy_weights, patch_entropy
from vtprune.methods.functional import lowest_kept, recycle
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext

RELEASED_THRESHOLD, RELEASED_CELL, RELEASED_TOKENS, RELEASED_SIDE = 35.0, 15.58, 730, 27


@register_method
@dataclass(frozen=True)
class VFlowOpt(Scorer):
    """Vision-tower importance map, pre-LLM recycling, drops at layers 9/18 of 28 (VFlowOpt)."""

    name: ClassVar[str] = "vflowopt"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
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
            if getattr(self, name) is not None:
                options.number(getattr(self, name), name, 0.0, 1.0, low_open=True)
        if self.cell is not None:
            options.number(self.cell, "cell", 0.0, low_open=True, hint=" (grid-cell side a, in tokens)")
        if self.threshold is not None:
            options.number(self.threshold, "threshold", 0.0, hint=" (received attention above which a token's row "
                           "counts; None: the release's 35 scaled to the tower)")
        options.number(self.alpha, "alpha", hint=" (weight of the entropy term; released configs: 0)")
        options.flag(self.recycle, "recycle")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, list | tuple) or len(value) != 3:
                raise ValueError(f"{name}={value!r} must be three numbers (one per RGB channel), e.g. "
                                 "[0.481, 0.458, 0.408].")
            for i, v in enumerate(value):
                options.number(v, f"{name}[{i}]", 0.0, low_open=name == "image_std")

    # -- schedule ------------------------------------------------------------------------------------------
    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        """Stages for the average-retention ``budget`` if given, else ending exactly at the final ``keep``."""
        return schedules.vflowopt(num_layers, keep, self.budget, (self.r1, self.r2, self.r3), self.layers)

    # -- captures ------------------------------------------------------------------------------------------
    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """The vision tower's pixels (entropy term) and the chosen ViT layer's input (the importance map)."""
        if hasattr(adapter, "vit_blocks"):
            return self._qwen_captures(adapter)
        layers = vit.encoder_layers(adapter)
        index = vit.feature_layer_index(adapter) if self.vit_layer is None else stage_layer(self.vit_layer, "vit_layer")
        if not 0 <= index < len(layers):
            raise ValueError(f"vit_layer={self.vit_layer} is outside the {len(layers)}-layer vision tower; "
                             f"use 0..{len(layers) - 1} (None: the projector's feature layer).")
        stats = vit.pixel_statistics(adapter, self.image_mean, self.image_std)
        patch = int(adapter.config.vision_config.patch_size)
        # generate() runs the tower before its first forward: these captures may run outside it.
        return (Capture(adapter.vision_tower, self._grab_pixels, before=True, outside_forward=True),
                Capture(layers[index], self._grab_layer(adapter, stats, patch), before=True, outside_forward=True))

    def _grab_pixels(self, state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        if self.alpha:
            state["vflowopt_pixels"] = args[0] if args else kwargs.get("pixel_values")

    def _grab_layer(self, adapter: Any, stats: tuple, patch: int):
        def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                attention = vit.vit_attention(module, hidden)
                tokens = attention.shape[-1]
                threshold = self.threshold if self.threshold is not None else RELEASED_THRESHOLD * tokens / RELEASED_TOKENS
                crops = vit.crop_tokens(adapter, vit.context_relevance(attention, float(threshold)))
                pixels = state.pop("vflowopt_pixels", None)
                if self.alpha and pixels is not None:
                    rgb = denormalize(pixels.reshape(-1, *pixels.shape[-3:]), *stats)
                    weights = entropy_weights(patch_entropy(rgb, patch)).to(crops.device)
                    crops = crops.clone()
                    crops[:, -weights.shape[1]:] += self.alpha * weights
            state["vflowopt_crops"] = crops

        return grab

    def _qwen_captures(self, adapter: Any) -> tuple[Capture, ...]:
        """The tower's ``grid_thw`` (and pixels) and the input of the chosen full-attention block."""
        index = qwen_vit.choose_block(adapter, self.vit_layer)
        stats = vit.pixel_statistics(adapter, self.image_mean, self.image_std)
        patch = int(adapter.config.vision_config.patch_size)
        return (Capture(adapter.vision_tower, self._grab_tower, before=True, outside_forward=True),
                Capture(adapter.vit_blocks[index], self._grab_block(adapter, stats, patch), before=True,
                        outside_forward=True))

    def _grab_tower(self, state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        state["vflowopt_grid"] = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if self.alpha:
            state["vflowopt_pixels"] = args[0] if args else kwargs.get("hidden_states")

    def _grab_block(self, adapter: Any, stats: tuple, patch: int):
        def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            grid = state.pop("vflowopt_grid", None)
            if grid is None:
                raise RuntimeError("vflowopt saw a Qwen-VL ViT block run without the tower's grid_thw.")
            hidden = args[0] if args else kwargs["hidden_states"]
            with torch.no_grad():
                images = qwen_vit.image_maps(adapter, module, hidden, kwargs, grid, self._threshold)
                pixels = state.pop("vflowopt_pixels", None)
                if self.alpha and pixels is not None:
                    weights = qwen_vit.pixel_entropy_map(pixels, grid, stats, patch, adapter.merge_size ** 2)
                    parts = torch.split(weights.to(images[0][0].device), [v.numel() for v, _ in images])
                    images = [(v + self.alpha * w, g) for (v, g), w in zip(images, parts, strict=True)]
            state["vflowopt_images"] = images

        return grab

    def _threshold(self, tokens: int) -> float:
        """``t`` for a map over ``tokens`` patches: the option, else the release's 35 scaled from 730 tokens."""
        return float(self.threshold) if self.threshold is not None else RELEASED_THRESHOLD * tokens / RELEASED_TOKENS

    # -- scoring -------------------------------------------------------------------------------------------
    def importance(self, ctx: ScoreContext) -> torch.Tensor:
        """The map ``[B, N0max + 1]`` by visual ordinal (built once per call from the captured ViT layer)."""
        table = ctx.state.get("vflowopt")
        if table is None:
            crops = ctx.state.pop("vflowopt_crops", None)
            images = ctx.state.pop("vflowopt_images", None)
            if crops is None and images is None:
                raise RuntimeError("vflowopt found no vision-tower map for this call (were images passed?).")
            counts = list(ctx.visual_counts) if ctx.visual_counts is not None else ctx.num_visual.tolist()
            if images is not None:  # Qwen-VL: per-image maps, laid out in batch order
                vit.check_images_only(ctx.inputs)
                maps = vit.distribute(images, counts, ctx.adapter.config.model_type)
            else:
                maps = vit.arrange(ctx.adapter, crops, ctx.inputs, counts)
            table = torch.zeros(len(counts), max(counts) + 1, device=ctx.valid.device)
            for row, (values, _) in enumerate(maps):
                table[row, : values.numel()] = values.to(table.device)
            ctx.state["vflowopt"], ctx.state["vflowopt_grids"] = table, [grids for _, grids in maps]
        return table

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        table = self.importance(ctx)
        values = table.gather(1, ctx.ordinal.clamp(min=0))
        return torch.where(ctx.ordinal >= 0, values, torch.zeros_like(values))

    def cell_side(self, ctx: ScoreContext) -> float:
        side = ctx.adapter.config.vision_config.image_size // ctx.adapter.config.vision_config.patch_size
        return float(self.cell) if self.cell is not None else RELEASED_CELL * side / RELEASED_SIDE

    def cells(self, ctx: ScoreContext, segments: list, count: int) -> tuple[torch.Tensor, int, int]:
        """Cell of each of the sample's ``count`` visual tokens ``[count]``, its merge count ``n_merge`` and its
        number of cells (host ints).

        One side ``a`` for the call (``cell``, or the release's scaled to a CLIP / SigLIP crop): ``n_merge =
        floor(N / a^2)``. Qwen-VL without ``cell``: ``a`` per image (:data:`RELEASED_CELL` ``/ 27`` of the side
        of a square with the image's ``h w`` merged tokens), ``n_merge = sum_images floor(h w t / a^2)``.
        """
        if self.cell is not None or not hasattr(ctx.adapter, "vit_blocks"):
            a = self.cell_side(ctx)
            return vit.cell_ids(segments, count, a), math.floor(count / (a * a)), vit.cell_count(segments, a)
        sides = [RELEASED_CELL * math.sqrt(s.h * s.w) / RELEASED_SIDE for s in segments]
        merged = sum(math.floor(s.length / (a * a)) for s, a in zip(segments, sides, strict=True))
        return vit.cell_ids(segments, count, sides), merged, vit.cell_count(segments, sides)

    def merge(self, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recycling at the first stage: merge pruned tokens per grid cell into the cell's top member."""
        alive = ctx.visual & ctx.valid
        first = not ctx.state.get("vflowopt_staged")
        ctx.state["vflowopt_staged"] = True
        if not (self.recycle and first):
            return kept, hidden
        merges, num_cells, rows = [], 1, []
        for row, segments in enumerate(ctx.state["vflowopt_grids"]):
            ids, n_merge, row_cells = self.cells(ctx, segments, ctx.visual_counts[row])
            merges.append(n_merge)
            num_cells = max(num_cells, row_cells)
            rows.append(ids)
        # One host table of cell ids by visual ordinal [B, N0max] plus each sample's merge count in the last
        # column, copied to the device once; looked up without boolean masks.
        width = max((r.numel() for r in rows), default=0)
        if width == 0:  # no visual token in the batch
            return kept, hidden
        table = torch.full((len(rows), width + 1), -1, dtype=torch.long)
        for row, ids in enumerate(rows):
            table[row, : ids.numel()] = ids
        table[:, width] = torch.tensor(merges, dtype=torch.long)
        table = table.to(kept.device)
        cells = torch.where(ctx.ordinal >= 0, table[:, :width].gather(1, ctx.ordinal.clamp(0, width - 1)), -1)
        # A sample with nothing pruned recycles nothing (keep 1 is the unwrapped model), decided on the device.
        pruned = (alive & ~kept).any(dim=1)
        n_merge = torch.where(pruned, table[:, width], 0)
        demoted = lowest_kept(scores, kept & alive, n_merge)
        candidate = alive & (~kept | demoted)
        representative, hidden = recycle(hidden, scores, candidate, cells, num_cells=num_cells)
        return (kept & ~demoted) | representative, hidden
