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
paper's layer 7) on. Other depths scale the layers (:func:`vtprune.methods.schedules.transprune`). A ``keep``
other than 0.125 scales the *dropped* fractions: ``r_i = 1 - (1 - r_i^paper) * (1 - keep) / 0.875``, so the
last stage keeps exactly ``keep`` (``keep=0.125`` is the paper's TransPrune-High).

Release (liaolea/TransPrune ``modeling_llama_transprune.py``, ``parity="release"``, also for ``ttv``): as
PyramidDrop's, ``int(N0 * ratio_s)`` tokens per stage and position ids compacted after each drop (decode ids
shifted by ``cur_visual_length - next_visual_length`` per stage); the debiasing release has no TransPrune patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage, stage_layer
from vtprune.methods import options, schedules
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.functional import normalise_alive, ttv, ttv_terms
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext


@register_method
@dataclass(frozen=True)
class TokenTransitionVariation(Scorer):
    """TransPrune's token transition variation only (attention-free), layers 7/9/12 of 32."""

    name: ClassVar[str] = "ttv"
    requires: ClassVar[frozenset[str]] = frozenset({"llm_layers"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="truncate", positions="compact", source="liaolea/TransPrune")
    abs_cos: bool = False
    ttv_start: int | None = None

    def __post_init__(self) -> None:
        options.flag(self.abs_cos, "abs_cos")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return schedules.transprune(num_layers, keep)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """The two norms (sub-block inputs), ``self_attn`` and ``mlp`` (outputs) of the accumulation layers."""
        stages = tuple(s for s in stages if s.layer > 0)
        if not stages:
            return ()
        start = stages[0].layer - 1 if self.ttv_start is None else stage_layer(self.ttv_start, "ttv_start")
        if not 0 <= start < stages[-1].layer:
            raise ValueError(
                f"ttv_start={self.ttv_start} must be in [0, {stages[-1].layer - 1}] (before the last stage "
                f"at layer {stages[-1].layer}); leave it None to start one layer before the first stage."
            )
        captures = []
        for index in range(start, stages[-1].layer):
            layer = adapter.decoder_layers[index]
            for part, norm, block in (("attn", layer.input_layernorm, layer.self_attn),
                                      ("mlp", layer.post_attention_layernorm, layer.mlp)):
                captures += [Capture(norm, _save_input(index, part)), Capture(block, self._save_terms(index, part))]
        return tuple(captures)

    def _save_terms(self, index: int, part: str):
        def save(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            t_in = state.get("ttv_inputs", {}).pop((index, part), None)
            if t_in is None:
                return
            t_out = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                state.setdefault("ttv_pending", []).append(ttv_terms(t_in, t_out, self.abs_cos))

        return save

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

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return self.accumulated_ttv(ctx)


def _save_input(index: int, part: str):
    def save(state: dict, module: Any, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        state.setdefault("ttv_inputs", {})[(index, part)] = output

    return save


@register_method
@dataclass(frozen=True)
class TransPrune(TokenTransitionVariation):
    """Token transition variation + instruction-guided attention, layers 7/9/12 of 32 (alpha 0.5)."""

    name: ClassVar[str] = "transprune"
    requires: ClassVar[frozenset[str]] = frozenset({"attention", "llm_layers"})
    alpha: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        options.number(self.alpha, "alpha", 0.0, 1.0, hint=" (weight of TTV against IGA; paper: 0.5)")

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        alive = ctx.visual & ctx.valid
        terms = normalise_alive(self.accumulated_ttv(ctx), alive) * self.alpha
        if self.alpha < 1.0:
            terms = terms + normalise_alive(ctx.attention("instruction"), alive) * (1.0 - self.alpha)
        return terms
