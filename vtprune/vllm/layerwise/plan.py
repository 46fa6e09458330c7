"""Where a layer-wise method prunes inside vLLM's language model and how many tokens each layer region holds.

Pure functions (no vLLM import): the front end, the scheduler (KV allocation) and the workers compute the same
numbers from the same inputs. The stages are vtprune's own (:meth:`vtprune.methods.base.Scorer.schedule`, or
``layer=K``), counted as vtprune's transformers path counts them with its default rounding
(``keep_count(keep_s, N0)`` over a request's ``N0`` visual tokens, never more than the previous stage kept).

Layer regions: region 0 holds the layers before the first stage (every token), region ``s`` the layers from stage
``s``'s layer up to the next stage. A request holds ``tokens - pruned[s]`` tokens (and KV entries) in region ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vtprune.config import Stage, keep_count

#: Methods that prune inside the language model and run in vLLM.
LAYER_METHODS = ("fastv", "pdrop", "transprune", "ttv", "dart")


@dataclass(frozen=True)
class LayerPlan:
    """The scorer and stage layers of one served model. ``stages`` are those of the model's default keep; a request's
    keep gives its own stage fractions at the same layers (:meth:`stages_for`)."""

    scorer: Any
    stages: tuple[Stage, ...]
    num_layers: int
    layer: int | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        """The stage layers (the first decoder layer of each pruned region)."""
        return tuple(stage.layer for stage in self.stages)

    @property
    def score_layers(self) -> tuple[int, ...]:
        """The decoder layer whose input scores each stage (``<=`` the stage's layer)."""
        return tuple(self.scorer.score_layer(stage) for stage in self.stages)

    @property
    def first_layer(self) -> int:
        """The first layer that reads anything for scoring (a score layer or a capture may sit below the stage)."""
        return min(self.score_layers)

    def region_of_layer(self, index: int) -> int:
        """The region of decoder layer ``index``: how many stages sit at or below it."""
        return sum(1 for layer in self.layers if layer <= index)

    def stages_for(self, keep: float) -> tuple[Stage, ...]:
        """The stages at a request's ``keep`` (the same layers as :attr:`stages`)."""
        if self.layer is not None:
            return (Stage(self.layer, keep),)
        return tuple(self.scorer.schedule(self.num_layers, keep))

    def kept_counts(self, num_visual: int, keep: float) -> tuple[int, ...]:
        """Visual tokens each stage keeps of a request's ``num_visual``: ``keep_count(keep_s, N0)``, never more than
        the previous stage (the engine keeps ``min(planned, alive)``)."""
        counts, alive = [], num_visual
        for stage in self.stages_for(keep):
            alive = min(keep_count(stage.keep, num_visual), alive)
            counts.append(alive)
        return tuple(counts)

    def pruned_counts(self, num_visual: int, keep: float) -> tuple[int, ...]:
        """Tokens missing from each region of a request (``[0, N0 - kept_1, N0 - kept_2, ...]``); all zeros for a
        request without visual tokens or at ``keep`` 1.0."""
        return (0, *(num_visual - kept for kept in self.kept_counts(num_visual, keep)))


def make_layer_plan(method: str, keep: float, num_layers: int, *, options: dict | None = None,
                    debias: bool | str = False, layer: int | None = None, min_layer: int = 1,
                    model_type: str = "model", hf_config: Any = None) -> LayerPlan:
    """The :class:`LayerPlan` of a served model, checked once at start-up (one-line ``ValueError`` otherwise).

    ``min_layer``: the first layer allowed to see a pruned sequence (Qwen3-VL: after its DeepStack layers).
    ``hf_config``: the served model's config; ``debias=True`` reads the ``calibration.json`` shipped beside it, as
    vtprune's transformers path does.
    The stage layers must not depend on ``keep``: a request's keep changes only how many tokens each stage keeps.
    """
    from vtprune.config import stage_layer, validate_stages
    from vtprune.methods.registry import resolve
    from vtprune.plan import check_stages

    model = SimpleNamespace(config=hf_config) if hf_config is not None else None
    scorer = resolve(method, dict(options or {}), debias=debias, model=model)
    if scorer.kv_retention() is not None:
        raise ValueError(f"vtprune: {method!r} retains KV entries instead of pruning; it has its own vLLM path.")
    if layer is not None:
        layer = stage_layer(layer, "layer (the first decoder layer that sees pruned tokens)")
    plan = LayerPlan(scorer=scorer, stages=(), num_layers=num_layers, layer=layer)
    stages = plan.stages_for(keep)
    validate_stages(stages, num_layers)
    view = SimpleNamespace(num_layers=num_layers, min_prune_layer=lambda: min_layer,
                           config=SimpleNamespace(model_type=model_type))
    inside = [stage.layer for stage in stages if stage.layer < min_layer]
    if inside:
        raise ValueError(f"vtprune: {method!r} would prune at layer {inside[0]}, but {model_type} adds DeepStack "
                         f"features to its first {min_layer} layers; give layer={min_layer} or more (vtprune serve "
                         f"--layer {min_layer}).")
    check_stages(stages, view, scorer, SimpleNamespace(method=method))
    if stages[0].layer == 0:
        raise ValueError(f"vtprune: {method!r} at layer 0 prunes before the language model; serve a pre-LLM method "
                         "(divprune, visionzip) for that, or a layer >= 1.")
    layers = tuple(stage.layer for stage in stages)
    for probe in (1.0, 0.5, 0.1, 0.01):
        if tuple(stage.layer for stage in plan.stages_for(probe)) != layers:
            raise ValueError(f"vtprune: {method!r} moves its stage layers with keep ({layers} at keep={keep}); "
                             "per-request keeps need fixed layers: give layer=K.")
    return LayerPlan(scorer=scorer, stages=tuple(stages), num_layers=num_layers, layer=layer)


#: PrefixKV options the vLLM plugin does not serve, and why (the defaults: scope="visual", exact counts, decode="keep").
RETENTION_REFUSED = {
    "scope": ("visual", "scope='prompt' evicts text entries too, which the plugin does not count yet"),
    "counting": ("exact", "counting='release' (parity='release') is served by the transformers path only"),
    "decode": ("keep", "decode='release' masks entries during decoding, which the plugin does not do"),
    "profile": (None, "a calibrated profile is served by the transformers path only; the plugin searches the "
                      "per-layer counts per request"),
}


def make_retention_scorer(method: str, options: dict | None = None, hf_config: Any = None) -> Any:
    """PrefixKV's scorer for a served model, checked once at start-up (one-line ``ValueError`` otherwise)."""
    from vtprune.methods.registry import resolve

    model = SimpleNamespace(config=hf_config) if hf_config is not None else None
    scorer = resolve(method, dict(options or {}), model=model)
    if scorer.kv_retention() is None:
        raise ValueError(f"vtprune: {method!r} prunes the sequence; it is not a KV-retention method.")
    for name, (default, why) in RETENTION_REFUSED.items():
        if getattr(scorer, name) != default:
            raise ValueError(f"vtprune: {method!r} in vLLM: {why}; drop {name}={getattr(scorer, name)!r}.")
    return scorer

