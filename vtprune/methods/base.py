"""The method interface: a :class:`Scorer` is one small frozen object with one ``score(ctx) -> [B, L]``.

A scorer says which visual tokens matter; the engine keeps the top ``keep_count(stage.keep, N0)`` of every
sample at each stage of the plan. Everything else is optional:

* ``requires``: what the scorer needs from the model, checked at wrap time against the adapter's
  capabilities (``"attention"``: language-model attention rows recomputed from a layer's q/k;
  ``"llm_layers"``: what decoder layers compute; ``"clip_tower"``: a CLIP / SigLIP vision tower). A scorer
  that requires ``attention`` or ``llm_layers`` cannot run a pre-LLM stage (layer 0).
* ``score_offset``: the stage at layer ``K`` is scored on the input of layer ``K - score_offset``.
* :meth:`schedule`: the default stages for a model depth and a final ``keep`` (one of the plain functions
  of :mod:`vtprune.methods.schedules`).
* :meth:`captures`: extra tensors to capture (hooks the engine registers, stores per call and removes).
* :meth:`kv_retention`: a :class:`KVRetention` instead of sequence pruning (PrefixKV); None by default.
* ``merge(ctx, kept, scores, hidden) -> (kept, hidden)``: an explicit step after selection that may change
  the kept mask and write merged tokens (VFlowOpt's recycling); define it only if the scorer merges. Return
  the ``kept`` object itself when the selection is unchanged: the engine then reads no counts back.

A user-defined scorer needs no registration: pass an instance to :func:`vtprune.wrap`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vtprune.config import Stage
from vtprune.methods import schedules
from vtprune.scoring import ScoreContext


@dataclass(frozen=True)
class Capture:
    """A hook the engine registers on ``module`` for a scorer, for as long as the model is wrapped.

    ``fn(state, module, args, kwargs, output)`` runs during prefills with visual tokens (never while
    decoding) and writes into ``state``, the call's own dict (``ctx.state`` when scoring). ``before``: a
    forward pre-hook (``output`` is None). ``outside_forward``: the module may run outside the model's forward
    (``generate()`` encodes images first); such captures wait for the next call on the thread.
    """

    module: nn.Module
    fn: Callable[[dict, nn.Module, tuple, dict, Any], None]
    before: bool = False
    outside_forward: bool = False


@dataclass(frozen=True)
class KVRetention:
    """KV-cache retention instead of sequence pruning, as a scorer declares it (:meth:`Scorer.kv_retention`).

    The hidden states keep every token; ``score`` runs at every decoder layer and gives the priority ``[B, L]``
    of that layer's cached keys, and after the prefill each layer's cache keeps its own top entries. ``scope``:
    the tokens that may leave (``"visual"``, or ``"prompt"``: the prompt but its first ``start`` tokens and its
    last one); ``profile``: a file of per-layer eviction ratios (None: the counts are searched per call);
    ``counting``: ``"exact"`` or ``"release"`` (the released code's counts); ``decode``: ``"keep"`` (generated
    tokens stay) or ``"release"`` (each layer evicts while decoding, ``distance`` entries from the end of the
    compressed prompt). The plan carries it (:class:`vtprune.plan.KVPlan`); the engine reads only the plan.
    """

    scope: str = "visual"
    start: int = 1
    profile: str | None = None
    counting: str = "exact"
    decode: str = "keep"
    distance: int = -25


@dataclass(frozen=True)
class Scorer:
    """Base class of every method. Subclass it as a frozen dataclass, set ``name``, implement :meth:`score`."""

    name: ClassVar[str] = "custom"
    requires: ClassVar[frozenset[str]] = frozenset()
    score_offset: ClassVar[int] = 0

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """``[B, L]`` importance of the current slots; only alive visual slots are ranked (higher is kept).

        ``ctx.stage`` is the stage being scored; ``ctx.attention("last" | "instruction")`` gives attention rows.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score(ctx) -> [B, L]")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        """Default stages for a model with ``num_layers`` decoder layers ending at ``keep`` (prune at layer 2)."""
        return schedules.single_layer(num_layers, keep)

    def score_layer(self, stage: Stage) -> int:
        """The decoder layer whose input is scored for ``stage`` (``<= stage.layer``)."""
        return stage.layer - self.score_offset

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """Extra hooks (see :class:`Capture`); raise ``ValueError`` here for options the model cannot serve."""
        return ()

    def kv_retention(self) -> KVRetention | None:
        """KV-cache retention instead of sequence pruning (PrefixKV), or None (the default: the scorer prunes)."""
        return None

    @property
    def retains_kv(self) -> bool:
        """Whether the scorer retains KV entries instead of pruning the sequence (:meth:`kv_retention`)."""
        return self.kv_retention() is not None

    @property
    def description(self) -> str:
        """One line for ``vtprune info``: the first line of the class docstring."""
        return (type(self).__doc__ or self.name).strip().splitlines()[0]


@dataclass(frozen=True)
class Wrapper(Scorer):
    """A scorer around another one (composition: ``Debiased(FastV())``, ``PerFrame(...)``): it delegates all but
    what it changes."""

    inner: Scorer

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def requires(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.requires

    @property
    def score_offset(self) -> int:  # type: ignore[override]
        return self.inner.score_offset

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        return self.inner.score(ctx)

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return self.inner.schedule(num_layers, keep)

    def score_layer(self, stage: Stage) -> int:
        return self.inner.score_layer(stage)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        return self.inner.captures(adapter, stages)

    def kv_retention(self) -> KVRetention | None:
        """The inner scorer's: a wrapper around a KV-retention scorer retains KV too (a wrapper that cannot serve
        KV retention refuses such an inner scorer when it is built)."""
        return self.inner.kv_retention()

    def __getattr__(self, name: str) -> Any:  # ``merge`` and the inner scorer's options
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def merge_step(scorer: Scorer) -> Callable | None:
    """The scorer's ``merge`` step, or None when it only scores."""
    return getattr(scorer, "merge", None)


Method = Scorer  # the name of the base class before 0.2 (deprecated; subclass Scorer)
