"""Public entry points: :func:`wrap` (hooks stay until ``remove()``) and :func:`apply` (a context manager)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from vtprune.adapters import get_adapter
from vtprune.config import PruneConfig
from vtprune.engine import RECORD_INDICES, PruneHandle
from vtprune.methods import Scorer, resolve
from vtprune.plan import make_plan

UNSUPPORTED_ATTENTION = ("flex_attention",)


def wrap(model: nn.Module, method: str | Scorer | PruneConfig = "fastv", keep: float = 0.25, *,
         record_indices: int = RECORD_INDICES, **options: Any) -> PruneHandle:
    """Prune the visual tokens of ``model`` in every later forward / ``generate`` call.

    Parameters
    ----------
    model: a supported ``*ForConditionalGeneration`` model (see ``vtprune info``).
    method: a name from :func:`vtprune.list_methods` (``"fastv+debias"`` adds debiasing), a scorer instance
        (:class:`vtprune.Scorer`, e.g. your own) or a :class:`PruneConfig`.
    keep: final fraction of visual tokens kept, in ``(0, 1]``.
    options: :class:`PruneConfig` fields (``schedule="2:0.5,8:0.25"``, ``layer=2``, ``positions``,
        ``debias``, ``seed``, ``parity="release"``, ``logits="pruned"``, ``rounding="per_image"``) and method
        options (e.g. ``alpha=0.5``).
        Logits come back in the input layout (one row per input token, pruned visual positions NaN) unless
        ``logits="pruned"``; see :mod:`vtprune.outputs`.
    record_indices: how many of the most recent calls keep their ``kept_indices`` in ``handle.stats``
        (counts are kept for the last 1,000 calls; older kept indices are dropped to bound memory).

    Returns the :class:`PruneHandle`; ``handle.remove()`` restores the pristine model.

    Examples
    --------
    >>> handle = vtprune.wrap(model, method="fastv", keep=0.25)    # doctest: +SKIP
    >>> out = model.generate(**inputs, max_new_tokens=32)            # doctest: +SKIP
    >>> handle.remove()                                              # doctest: +SKIP
    """
    scorer = method if isinstance(method, Scorer) else None
    if isinstance(method, PruneConfig):
        config = method
    elif scorer is not None:  # an instance: its name labels the stats; only debias= may be added to it
        debias = options.get("debias", False)
        config = dataclasses.replace(_config_from(scorer.name, keep, options), debias=debias)
    else:
        config = _config_from(method, keep, options)
    existing = getattr(model, "_vtprune_handle", None)
    if existing is not None and existing.active:
        raise ValueError(
            f"this model is already wrapped ({existing!r}); call handle.remove() before wrapping it again."
        )
    _check_not_compiled(model)
    adapter = get_adapter(model)
    _check_attention(adapter.attn_implementation)
    if scorer is not None and config.options:
        raise ValueError(f"options {sorted(config.options)} are for named methods; set them on the scorer instance.")
    scorer = resolve(scorer or config.method, config.options, debias=config.debias, seed=config.seed, model=model)
    handle = PruneHandle(model, adapter, make_plan(config, scorer, adapter), config, record_indices=record_indices)
    model._vtprune_handle = handle
    return handle


@contextmanager
def apply(model: nn.Module, method: str | PruneConfig = "fastv", keep: float = 0.25, **options: Any
          ) -> Iterator[PruneHandle]:
    """Context-manager form of :func:`wrap`: the hooks are removed on exit, also after an exception."""
    handle = wrap(model, method, keep, **options)
    try:
        yield handle
    finally:
        handle.remove()


_CONFIG_FIELDS = ("schedule", "layer", "positions", "debias", "seed", "parity", "logits", "rounding")


def _config_from(method: str, keep: float, options: dict[str, Any]) -> PruneConfig:
    config_options = {k: options.pop(k) for k in _CONFIG_FIELDS if k in options}
    return PruneConfig(method=method, keep=keep, options=dict(options), **config_options)


def _check_not_compiled(model: nn.Module) -> None:
    """Refuse a model compiled before wrapping: its traced graphs would silently skip the hooks."""
    compiled = (
        type(model).__name__ == "OptimizedModule"
        or getattr(model, "_compiled_call_impl", None) is not None
        or hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable")
    )
    if compiled:
        raise ValueError(
            "vtprune cannot wrap a model that torch.compile already compiled (the compiled graphs would skip "
            "its hooks and run unpruned). Wrap the plain model first, then compile it: "
            "`handle = vtprune.wrap(model, ...); model = torch.compile(model)`."
        )


def _check_attention(implementation: str) -> None:
    if implementation in UNSUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by vtprune; load the model with "
            "attn_implementation='sdpa' (default), 'eager' or 'flash_attention_2'."
        )
