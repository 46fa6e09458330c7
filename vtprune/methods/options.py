"""Checks of method options at wrap time (a ``ValueError`` naming the option, its value and what to give).

Python's ``bool`` is an ``int`` and ``float("nan")`` compares false with everything, so ``True`` would pass as
1 and ``nan`` as "in range" without these; a string would fail only later, inside ``generate``.
"""

from __future__ import annotations

import math
from typing import Any


def number(value: Any, name: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           hint: str = "") -> float:
    """``value`` as a finite float within ``[low, high]`` (``(low, high]`` with ``low_open``); not a bool."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        left = "(" if low_open else "["
        span = f" in {left}{low:g}, {high:g}]" if low is not None and high is not None else (
            f" {'>' if low_open else '>='} {low:g}" if low is not None else "")
        raise ValueError(f"{name}={value!r} must be a finite number{span}{hint}.")
    return float(value)


def flag(value: Any, name: str) -> bool:
    """``value`` if it is ``True`` or ``False`` (a string such as ``'false'`` would count as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False.")
    return value


def integer(value: Any, name: str, low: int | None = None) -> int:
    """``value`` if it is an int (not a bool) ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise ValueError(f"{name}={value!r} must be an int{f' >= {low}' if low is not None else ''}.")
    return value
