"""Pruning methods: a method is a :class:`Scorer` (which visual tokens matter) with a default schedule (where
and how much to prune, :mod:`vtprune.methods.schedules`).

Built-in methods, one file each: ``none``, ``random``, ``oracle`` (:mod:`.baselines`), ``fastv`` (:mod:`.fastv`),
``pdrop`` (:mod:`.pdrop`), ``ttv`` and ``transprune`` (:mod:`.transprune`), ``vflowopt`` (:mod:`.vflowopt`),
``per_frame`` (:mod:`.per_frame`), ``visionzip``, ``divprune``, ``dart``, ``temporal`` (:mod:`.visionzip`, ...);
``+debias`` wraps a scorer in :class:`~vtprune.methods.debias.Debiased`.
:func:`resolve` turns a name and options into a scorer; a user-defined scorer instance needs no registration.

Registration is automatic: importing this package imports every module in it, and a method module registers
its scorer with ``@register_method`` when imported. A new built-in method is one new file here, nothing else.
"""

import importlib
import pkgutil

from vtprune.methods.base import Capture, Method, Scorer, Wrapper
from vtprune.methods.debias import Debiased
from vtprune.methods.per_frame import PerFrame
from vtprune.methods.registry import METHODS, describe, list_methods, make_method, register_method, resolve
from vtprune.methods.schedules import scaled_layer


def _import_every_module() -> None:
    """Import each module of this package, so every built-in method's ``@register_method`` has run."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_module()

__all__ = ["METHODS", "Capture", "Debiased", "Method", "PerFrame", "Scorer", "Wrapper", "describe",
           "list_methods", "make_method", "register_method", "resolve", "scaled_layer"]
