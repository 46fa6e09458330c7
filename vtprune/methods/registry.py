"""The registry of named methods and the one resolver that turns ``"fastv+debias"`` and options into a scorer.

:func:`resolve` is used by :func:`vtprune.wrap`, the CLI and the lmms-eval plugin alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vtprune.config import split_method_name
from vtprune.methods.base import Scorer
from vtprune.methods.debias import Debiased, check_debias_option, debiaser_for, refuse_kv_retention

METHODS: dict[str, Callable[..., Scorer]] = {}


def register_method(factory: type[Scorer] | Callable[..., Scorer] | None = None, *, name: str | None = None):
    """Register a scorer class (under its ``name``) or a factory (under ``name=``). Usable as a decorator."""

    def add(item: Any) -> Any:
        METHODS[name or item.name] = item
        return item

    return add(factory) if factory is not None else add


def list_methods() -> list[str]:
    """Names accepted by ``vtprune.wrap(model, method=...)``."""
    return sorted(METHODS)


def describe(name: str) -> str:
    """One line about a registered method (the first line of its docstring)."""
    return (METHODS[name].__doc__ or name).strip().splitlines()[0]


def option_names(name: str) -> set[str]:
    """The options a registered method accepts (its dataclass fields, or its factory's parameters)."""
    import inspect

    factory = METHODS[name]
    if dataclasses.is_dataclass(factory):
        return {f.name for f in dataclasses.fields(factory)}
    return set(inspect.signature(factory).parameters)


def resolve(method: str | Scorer, options: dict[str, Any] | None = None, debias: bool | str = False,
            seed: int = 0, model: Any = None) -> Scorer:
    """The scorer for ``method``: a registered name (``"+debias"`` adds debiasing) with ``options``, or an
    instance (returned as is, debiased if asked). ``seed`` goes to methods that take one; ``model`` locates
    a shipped calibration for ``debias=True``. Unknown names and bad options raise ``ValueError``."""
    options = dict(options or {})
    debias = options.pop("debias", False) or debias
    if isinstance(method, Scorer):
        return with_debias(method, debias, model)
    base, suffix_debias = split_method_name(method)
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}; known methods: {', '.join(list_methods())}.")
    accepted = option_names(base)
    if "seed" in accepted:
        options.setdefault("seed", seed)
    if "debias" in accepted:  # a wrapper (per_frame) hands debiasing to its base method
        options["debias"] = debias or suffix_debias
        debias = suffix_debias = False
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"bad options {unknown} for method {base!r}; it accepts: {', '.join(sorted(accepted)) or 'none'}.")
    try:
        scorer = METHODS[base](**options)
    except TypeError as err:
        raise ValueError(f"bad options {options!r} for method {base!r}: {err}") from err
    return with_debias(scorer, debias or suffix_debias, model)


def with_debias(scorer: Scorer, debias: bool | str, model: Any) -> Scorer:
    """``Debiased(scorer)`` when ``debias`` is set (only attention-scored methods can be debiased)."""
    if not debias:
        return scorer
    debiasable = ", ".join(sorted(n for n, f in METHODS.items() if _debiasable(f)))
    if "attention" not in scorer.requires:
        raise ValueError(
            f"method {scorer.name!r} does not score with language-model attention, so debias does not apply to it; "
            f"drop debias / '+debias', or use one of: {debiasable}."
        )
    refuse_kv_retention(scorer, debiasable)
    option = check_debias_option(debias)
    return Debiased(inner=scorer, debiaser=debiaser_for(option, model), option=option)


def _debiasable(factory: Any) -> bool:
    """Whether a registered method scores with attention rows debiasing can filter, read without building it
    (factories and properties: no): it requires attention and does not retain KV entries instead."""
    value = getattr(factory, "requires", frozenset())
    retains = getattr(factory, "kv_retention", Scorer.kv_retention) is not Scorer.kv_retention
    return isinstance(value, frozenset) and "attention" in value and not retains


def make_method(name: str, options: dict[str, Any] | None = None) -> Scorer:
    """Deprecated alias of :func:`resolve` (the name before 0.2)."""
    return resolve(name, options)
