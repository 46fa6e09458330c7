"""IDPruner (Tan et al., "IDPruner: Harmonizing Importance and Diversity in Visual Token Pruning for MLLMs",
arXiv:2602.13315, 2026; release Tencent/AngelSlim ``token_compressor``, strategy ``idpruner``): Maximal Marginal
Relevance over the visual tokens entering the language model, before it.

Per image (or video frame) keeping ``T`` tokens (:func:`mmr_order`, the release's greedy loop): importance ``I``
is the raw score ``w`` min-max normalised (``(w - min w) / (max w - min w + 1e-6)``), similarity ``S`` the cosine
of the LLM-input embeddings (norms plus ``1e-8``). The first pick is the most important token; then each step
keeps the unkept token maximising ``lambda I_i - (1 - lambda) max_{j kept} S_ij``, ``parallel_k`` tokens per
step (``torch.topk``). Release defaults: ``mmr_lambda = 0.5``, ``parallel_k = 1``.

Importance (``importance``):

* ``"selector"`` (the release's; ``"auto"`` with ``selector`` given): the raw scores of a trained Vision Selector
  (AngelSlim ships ``AngelSlim/Qwen2.5-VL-{3B,7B}-Instruct-Selector``) on a sample's visual LLM-input embeddings
  ``[1, N, D] -> [1, N]``. ``selector`` is a callable / ``torch.nn.Module`` or a local folder in the release's
  layout (``config.json``, ``*.safetensors`` or ``*.bin``, and the ``*.py`` defining ``config["architecture"]``,
  loaded as AngelSlim loads it: that file is executed, so give only a folder you trust). vtprune ships no
  selector weights and downloads none.
* ``"attention"`` (``"auto"`` without a selector; vtprune's training-free stand-in, not in the release or the
  paper): the attention a token receives in the vision encoder, as ``vispruner`` reads it (CLS row of the
  projector's feature layer on CLIP; the mean over all queries on SigLIP and of the last full-attention block on
  Qwen-VL, summed over each 2x2 merge unit).

Families: all six, on the LLM-input embeddings (after the projector / merger, as the release for LLaVA and
Qwen2.5-VL); LLaVA-NeXT / OneVision base view and tiles are images apart (:func:`vtprune.methods.lm_inputs.
group_ids`); Qwen3-VL (DeepStack) prunes at layer ``n`` on the embeddings that entered the LLM. Where vtprune
differs from the release: the release keeps ``round(N (1 - ratio))`` of all ``N`` visual tokens of a sample at
once (one normalisation and one budget over its images); vtprune runs the selector once per sample but
normalises and selects per image, each keeping ``keep_count(keep, n)`` (a single image: the same; the release's
``round`` is vtprune's). ``parity="release"`` sets ``importance="selector"`` (refused without ``selector``).
Text-agnostic.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, options, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.methods.tower_picks import pick_priority
from vtprune.scoring import ScoreContext

RELEASED_LAMBDA = 0.5
RELEASED_PARALLEL_K = 1
KEY = "idpruner"
IMPORTANCE = ("auto", "selector", "attention")
VISION_ARGS = ("vision_hidden", "x", "hidden_states", "visual_embeds", "xs", "vision_embeds")  # the release's names


# -- pure functions ----------------------------------------------------------------------------------------
def min_max(scores: torch.Tensor) -> torch.Tensor:
    """``[n]`` fp32 ``(w - min w) / (max w - min w + 1e-6)`` of raw scores ``[n]`` (the release's importance)."""
    scores = scores.float()
    return (scores - scores.min()) / (scores.max() - scores.min() + 1e-6)


def cosine(features: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` fp32 cosine similarity of the rows of ``features`` ``[n, D]`` (norms plus ``1e-8``, as released)."""
    unit = features.float()
    unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
    return unit @ unit.T


def mmr_order(scores: torch.Tensor, features: torch.Tensor, count: int, mmr_lambda: float = RELEASED_LAMBDA,
              parallel_k: int = RELEASED_PARALLEL_K) -> torch.Tensor:
    """The first ``min(count, n)`` picks ``[k]`` of IDPruner's MMR greedy, in pick order.

    scores: ``[n]`` raw importance (min-max normalised here); features: ``[n, D]`` (cosine similarity). First step:
    the most important; then ``argmax lambda I_i - (1 - lambda) max_{j kept} S_ij`` over unkept ``i``,
    ``parallel_k`` per step.
    """
    n = scores.shape[0]
    count = min(int(count), n)
    importance = min_max(scores)
    similarity = cosine(features).to(importance.device)
    closest = torch.full((n,), -2.0, device=importance.device)  # max similarity to the kept set
    free = torch.ones(n, dtype=torch.bool, device=importance.device)
    picks: list[torch.Tensor] = []
    taken = 0
    while taken < count:
        step = min(parallel_k, count - taken)
        value = importance if not taken else mmr_lambda * importance - (1 - mmr_lambda) * closest
        best = torch.topk(value.masked_fill(~free, float("-inf")), k=step).indices
        picks.append(best)
        free[best] = False
        closest = torch.maximum(closest, similarity[:, best].max(dim=1).values)
        taken += step
    return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=importance.device)


# -- the selector ------------------------------------------------------------------------------------------
def load_selector(folder: str | Path) -> Any:
    """A Vision Selector from a local folder in AngelSlim's layout (see the module docstring), in eval mode."""
    path = Path(folder).expanduser()
    weights = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    sources = sorted(path.glob("*.py"))
    if not path.is_dir() or not (path / "config.json").is_file() or not weights or not sources:
        raise ValueError(f"selector={str(folder)!r}: give a local folder holding config.json, the weights "
                         "(*.safetensors or *.bin) and the selector's *.py, as AngelSlim's Vision Selector ships.")
    config = json.loads((path / "config.json").read_text())
    spec = importlib.util.spec_from_file_location(f"vtprune_selector_{abs(hash(str(path)))}", sources[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = config.get("architecture", "TransformerScorer")
    if not hasattr(module, name):
        raise ValueError(f"selector={str(folder)!r}: {sources[0].name} defines no class {name!r} (config.json's "
                         "'architecture'); fix the folder.")
    cls = getattr(module, name)
    model = cls(**{p: config[p] for p in inspect.signature(cls.__init__).parameters if p in config})
    if weights[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights[0]))
    else:
        state = torch.load(weights[0], map_location="cpu", weights_only=True)
    prefixes = ("module.", "visual.importance_scorer.", "_orig_mod.")
    cleaned = {}
    for key, value in state.items():
        for prefix in prefixes:
            key = key.replace(prefix, "")
        cleaned[key] = value
    model.load_state_dict(cleaned, strict=False)  # as released
    return model.eval()


def selector_scores(selector: Any, vision: torch.Tensor) -> torch.Tensor:
    """``[N]`` fp32 raw scores of ``selector`` on one sample's visual embeddings ``[N, D]``."""
    parameters = list(selector.parameters()) if isinstance(selector, torch.nn.Module) else []
    if parameters:
        vision = vision.to(device=parameters[0].device, dtype=parameters[0].dtype)
    call = selector.forward if isinstance(selector, torch.nn.Module) else selector
    try:
        names = [n for n in inspect.signature(call).parameters if n in VISION_ARGS]
    except (TypeError, ValueError):
        names = []
    with torch.no_grad():
        out = call(**{names[0]: vision[None]}) if names else call(vision[None])
    return out.reshape(-1).float()


@register_method
@dataclass(frozen=True)
class IDPruner(Scorer):
    """Maximal Marginal Relevance of importance and diversity per image, pre-LLM (IDPruner)."""

    name: ClassVar[str] = "idpruner"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Tencent/AngelSlim",
                                                 options=(("importance", "selector"),))
    mmr_lambda: float = RELEASED_LAMBDA
    parallel_k: int = RELEASED_PARALLEL_K
    importance: str = "auto"
    selector: Any = None
    vit_layer: int | None = None
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        options.number(self.mmr_lambda, "mmr_lambda", 0.0, 1.0,
                       hint=" (weight of importance against diversity; the release: 0.5)")
        options.integer(self.parallel_k, "parallel_k", 1)
        if self.importance not in IMPORTANCE:
            raise ValueError(f"importance={self.importance!r}: use 'auto', 'selector' (a trained Vision Selector, "
                             "as released; give selector=) or 'attention' (the vision tower's attention).")
        if self.importance == "selector" and self.selector is None:
            raise ValueError("importance='selector' needs selector=<folder or callable> (AngelSlim's Vision Selector; "
                             "vtprune ships none); or use importance='attention'.")
        model = self.selector
        if isinstance(model, str | Path):
            model = load_selector(model)
        elif model is not None and not callable(model):
            raise ValueError(f"selector={model!r}: give a folder path or a callable [1, N, D] -> [1, N].")
        object.__setattr__(self, "_model", model)  # the loaded selector: not an option, not compared

    def selector_model(self) -> Any:
        """The callable scoring ``[1, N, D] -> [1, N]`` (loaded from ``selector``), or None."""
        return getattr(self, "_model", None)

    def uses_selector(self) -> bool:
        return self.importance != "attention" and self.selector_model() is not None

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        later = (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()
        if self.uses_selector():
            return later
        return (*tower.captures(adapter, KEY, self.vit_layer, self.name, "auto", self.queries), *later)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        embeddings = lm_inputs.input_embeddings(ctx)
        alive = ctx.visual & ctx.valid
        if self.uses_selector():
            raw = torch.zeros(alive.shape, dtype=torch.float32, device=embeddings.device)
            for row in range(alive.shape[0]):
                slots = alive[row].to(embeddings.device)
                if bool(slots.any()):
                    raw[row, slots] = selector_scores(self.selector_model(), embeddings[row, slots]).to(raw.device)
        else:
            raw = tower.token_maps(ctx, KEY, self.name)[0].gather(1, ctx.ordinal.clamp(min=0))

        def priority(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                values = raw[row, slots.to(raw.device)]
                # a few picks beyond the quota settle the engine's rounding differences between images
                picks = mmr_order(values, embeddings[row, slots.to(embeddings.device)],
                                  int(quota[group]) + len(quota), float(self.mmr_lambda), int(self.parallel_k))
                out[slots] = pick_priority(values, picks.to(values.device)).to(out.device)
            return out

        return lm_inputs.per_image_scores(ctx, priority)


__all__ = ["IDPruner", "load_selector", "mmr_order", "selector_scores"]
