"""Pruning methods: a method is a :class:`Scorer` (which visual tokens matter) with a default schedule (where
and how much to prune, :mod:`vtprune.methods.schedules`).

Built-in methods, one file each: ``none``, ``random``, ``oracle`` (:mod:`.baselines`), ``fastv`` (:mod:`.fastv`),
``pdrop`` (:mod:`.pdrop`), ``ttv`` and ``transprune`` (:mod:`.transprune`), ``vflowopt`` (:mod:`.vflowopt`),
``per_frame`` (:mod:`.per_frame`), ``visionzip``, ``divprune``, ``dart``, ``temporal`` (:mod:`.visionzip`, ...);
``+debias`` wraps a scorer in :class:`~vtprune.methods.debias.Debiased`.
:func:`resolve` turns a name and options into a scorer; a user-defined scorer instance needs no registration.
"""

from vtprune.methods import baselines, fastv, pdrop, per_frame, prefixkv, transprune, vflowopt  # noqa: F401
from vtprune.methods.base import Capture, Method, Scorer, Wrapper
from vtprune.methods.debias import Debiased
from vtprune.methods.per_frame import PerFrame
from vtprune.methods.registry import METHODS, describe, list_methods, make_method, register_method, resolve
from vtprune.methods.schedules import scaled_layer

from . import dart, divprune, temporal, visionzip  # noqa: F401 - register

__all__ = ["METHODS", "Capture", "Debiased", "Method", "PerFrame", "Scorer", "Wrapper", "describe",
           "list_methods", "make_method", "register_method", "resolve", "scaled_layer"]
