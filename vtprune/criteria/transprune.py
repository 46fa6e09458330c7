"""TransPrune (Li et al., arXiv:2507.20630): token transition variation plus instruction-guided attention.

* **TTV** (attention-free): for the attention and MLP sub-blocks of each accumulation layer,
  ``TTV_F(t) = softmax_t(1 - cos(T_out, T_in)) * ||T_out|| / ||T_in||`` with ``T_in`` the normalised
  sub-block input (``input_layernorm(x)`` / ``post_attention_layernorm(h)``) and ``T_out`` its output
  before the residual (``self_attn`` / ``mlp``); the softmax runs per sample over its valid tokens.
  ``TTV_l = TTV_attn + TTV_mlp`` is summed over the accumulation layers that ran before the stage.
  Captured by forward hooks on the two norms, ``self_attn`` and ``mlp`` into the call's own state (never
  while decoding); only ``[B, L]`` vectors are kept, re-indexed by visual ordinal at each stage, so they stay
  aligned after every gather.
* **IGA**: head- and query-averaged attention of the text after the last visual token
  (``ctx.attention("instruction")``), recomputed with the stage layer's own q/k on its input (= the output
  of the previous layer, the paper's ``IGA_{p+1}``); optional attention debiasing (``debias=``).
* Score: ``alpha * TTV / sum TTV + (1 - alpha) * IGA / sum IGA`` over the alive visual tokens (alpha 0.5).

Default schedule (LLaVA-1.5, 32 layers): prune before layers 7, 9, 12 (0-based; the paper's "after layers
7/9/12", 1-based) keeping 0.875 / 0.625 / 0.125 of ``N0``, TTV accumulated from layer 6 (0-based; the
paper's layer 7) on. Other depths scale the layers with :func:`vtprune.methods.scaled_layer`. A ``keep``
other than 0.125 scales the *dropped* fractions: ``r_i = 1 - (1 - r_i^paper) * (1 - keep) / 0.875``, so the
last stage keeps exactly ``keep`` (``keep=0.125`` is the paper's TransPrune-High).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.criteria.functional import normalise_alive, ttv, ttv_terms
from vtprune.methods import Method, _check_debias, _debias, register_method, scaled_layer
from vtprune.scoring import ScoreContext

PAPER_LAYERS = (7, 9, 12)
PAPER_KEEPS = (0.875, 0.625, 0.125)


def transprune_stages(num_layers: int, keep: float) -> tuple[Stage, ...]:
    """The paper's schedule scaled to ``num_layers`` and to a final ``keep`` (see the module docstring)."""
    keeps = [1.0 - (1.0 - r) * (1.0 - keep) / (1.0 - PAPER_KEEPS[-1]) for r in PAPER_KEEPS]
    keeps[-1] = keep
    stages: list[Stage] = []
    for layer, fraction in zip((scaled_layer(x, num_layers) for x in PAPER_LAYERS), keeps, strict=True):
        layer = max(layer, stages[-1].layer + 1 if stages else 1)
        if layer <= num_layers - 1:
            stages.append(Stage(layer, fraction))
        elif stages:
            stages[-1] = Stage(stages[-1].layer, fraction)
    return tuple(stages)


@register_method
@dataclass
class TokenTransitionVariation(Method):
    """TTV only (attention-free): rank by accumulated token transition variation (TransPrune, arXiv:2507.20630)."""

    name: ClassVar[str] = "ttv"
    description: ClassVar[str] = "TransPrune's token transition variation only (no attention)"
    supports_pre_llm: ClassVar[bool] = False
    abs_cos: bool = False
    ttv_start: int | None = None

    def default_stages(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return transprune_stages(num_layers, keep)

    # -- hooks ---------------------------------------------------------------------------------------------
    def prepare(self, handle: Any) -> None:
        """Hook the norms, ``self_attn`` and ``mlp`` of the accumulation layers and the language model."""
        stages = [s for s in handle.stages if s.layer > 0]
        if not stages:
            return
        start = stages[0].layer - 1 if self.ttv_start is None else int(self.ttv_start)
        if not 0 <= start < stages[-1].layer:
            handle.remove()
            raise ValueError(
                f"ttv_start={self.ttv_start} must be in [0, {stages[-1].layer - 1}] (before the last stage "
                f"at layer {stages[-1].layer}); leave it None to start one layer before the first stage."
            )
        self._handle = handle
        for index in range(start, stages[-1].layer):
            layer = handle.adapter.decoder_layers[index]
            for part, norm, block in (("attn", layer.input_layernorm, layer.self_attn),
                                      ("mlp", layer.post_attention_layernorm, layer.mlp)):
                handle.add_hook(norm.register_forward_hook(handle.eager(self._save_input(index, part))))
                handle.add_hook(block.register_forward_hook(handle.eager(self._save_terms(index, part))))

    def _save_input(self, index: int, part: str):
        def hook(module: Any, args: tuple, output: torch.Tensor) -> None:
            state = self._handle.call_state()
            if state is not None:  # a prefill with visual tokens (never while decoding)
                state.setdefault("ttv_inputs", {})[(index, part)] = output

        return hook

    def _save_terms(self, index: int, part: str):
        def hook(module: Any, args: tuple, output: Any) -> None:
            state = self._handle.call_state()
            if state is None:
                return
            t_in = state.get("ttv_inputs", {}).pop((index, part), None)
            if t_in is None:
                return
            t_out = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                state.setdefault("ttv_pending", []).append(ttv_terms(t_in, t_out, self.abs_cos))

        return hook

    # -- scoring -------------------------------------------------------------------------------------------
    def accumulated_ttv(self, ctx: ScoreContext) -> torch.Tensor:
        """Accumulated TTV ``[B, L]`` of the current slots (layers captured since the last stage folded in)."""
        batch = ctx.valid.shape[0]
        total = ctx.state.get("ttv")
        if total is None:
            total = torch.zeros(batch, max(ctx.visual_counts, default=0) + 1, device=ctx.valid.device)
        for magnitude, direction in ctx.state.pop("ttv_pending", []):
            magnitude, direction = magnitude.to(ctx.valid.device), direction.to(ctx.valid.device)
            if magnitude.shape != ctx.valid.shape:
                raise RuntimeError(f"TTV captured for {tuple(magnitude.shape)} slots but the stage has "
                                   f"{tuple(ctx.valid.shape)}; a hook saw another layout.")
            value = ttv(magnitude, direction, ctx.valid)
            # Scatter by ordinal; slots without one add 0 to the spare last column (no boolean indexing).
            slot = torch.where(ctx.ordinal >= 0, ctx.ordinal, total.shape[1] - 1)
            total = total.scatter_add(1, slot, torch.where(ctx.ordinal >= 0, value, 0.0).to(total.dtype))
        ctx.state["ttv"] = total
        gathered = total.gather(1, ctx.ordinal.clamp(min=0))
        return torch.where(ctx.ordinal >= 0, gathered, torch.zeros_like(gathered))

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        return self.accumulated_ttv(ctx)


@register_method
@dataclass
class TransPrune(TokenTransitionVariation):
    """TransPrune (Li et al., arXiv:2507.20630): ``alpha * TTV + (1 - alpha) * IGA``, progressive (3 stages)."""

    name: ClassVar[str] = "transprune"
    description: ClassVar[str] = "token transition variation + instruction-guided attention, layers 7/9/12 of 32"
    needs: ClassVar[frozenset[str]] = frozenset({"attention"})
    alpha: float = 0.5
    debias: bool | str = False

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"alpha={self.alpha!r} must be in [0, 1] (weight of TTV against IGA; paper: 0.5).")
        self.debias = _check_debias(self.debias)

    def score(self, ctx: ScoreContext, stage: Stage) -> torch.Tensor:
        alive = ctx.visual & ctx.valid
        terms = normalise_alive(self.accumulated_ttv(ctx), alive) * self.alpha
        if self.alpha < 1.0:
            iga = _debias(self, ctx, ctx.attention("instruction"))
            terms = terms + normalise_alive(iga, alive) * (1.0 - self.alpha)
        return terms

    def search_space(self, trial: Any, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        """Tunes ``alpha``; the final keep of the default schedule follows from the budget."""
        options = super().search_space(trial, budget, num_layers, adapter)
        return {"alpha": trial.suggest_float("alpha", 0.0, 1.0), **options}

    def search_defaults(self, budget: float, num_layers: int, adapter: Any = None) -> dict[str, Any]:
        return {"alpha": self.alpha}
