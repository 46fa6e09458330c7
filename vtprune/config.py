"""Configuration of a pruning run: method, keep fraction, schedule, and their validation.

Vocabulary used everywhere in vtprune:

* ``keep`` is the fraction of a sample's *original* visual tokens that survive, in ``(0, 1]``.
* A ``Stage(layer, keep)`` prunes right before decoder layer ``layer`` (0-based) runs, so layers
  ``0 .. layer-1`` see every visual token and layers ``>= layer`` see ``keep`` of them. ``layer=0`` is the
  pre-LLM stage (after the projector / patch merger, before the first decoder layer).
* The number of visual tokens kept from ``n`` is :func:`keep_count` ``= max(1, floor(keep * n + 0.5))``
  (round half up, at least one token), the single rounding rule of the package. ``parity="release"``
  swaps in a method's released rule (:func:`truncated_count` ``= int(n * keep)`` for PyramidDrop and
  TransPrune), chosen once by the plan (:meth:`vtprune.plan.Plan.kept_counts`).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

LOGITS_LAYOUTS = ("input", "pruned")
ROUNDINGS = ("sample", "per_image")


@dataclass(frozen=True)
class Stage:
    """One pruning point: before decoder layer ``layer`` keep ``keep`` of the original visual tokens."""

    layer: int
    keep: float


def split_method_name(name: str) -> tuple[str, bool]:
    """``"fastv+debias"`` -> ``("fastv", True)``; the only place the ``+debias`` suffix is parsed."""
    base, *suffixes = name.split("+")
    for suffix in suffixes:
        if suffix != "debias":
            raise ValueError(f"unknown method suffix '+{suffix}' in {name!r}; only '+debias' exists.")
    if len(suffixes) > 1:
        raise ValueError(f"method {name!r} repeats '+debias'; write it once, e.g. '{base}+debias'.")
    return base, bool(suffixes)


def keep_count(keep: float, n: int) -> int:
    """Number of visual tokens kept from ``n`` at fraction ``keep`` (round half up, at least 1, at most n)."""
    if n <= 0:
        return 0
    return int(min(n, max(1, math.floor(keep * n + 0.5))))


def truncated_count(keep: float, n: int) -> int:
    """``int(n * keep)`` (truncation, as PyramidDrop's and TransPrune's releases count), at least 1, at most n."""
    if n <= 0:
        return 0
    return int(min(n, max(1, int(n * keep))))


def parse_schedule(schedule: str | list | tuple | None) -> tuple[Stage, ...] | None:
    """Parse ``"2:0.5,8:0.25"`` (``;`` also separates stages) or ``[(2, 0.5), (8, 0.25)]`` into stages."""
    if schedule is None or schedule == "":
        return None
    if isinstance(schedule, str):
        items = [s for s in schedule.replace(";", ",").split(",") if s.strip()]
        pairs = []
        for item in items:
            if ":" not in item:
                raise ValueError(
                    f"schedule entry {item!r} is not of the form LAYER:KEEP; write e.g. schedule='2:0.5,8:0.25'."
                )
            layer, keep = item.split(":", 1)
            try:
                pairs.append((int(layer), float(keep)))
            except ValueError as err:
                raise ValueError(f"schedule entry {item!r}: LAYER must be an int and KEEP a float.") from err
    elif isinstance(schedule, list | tuple):
        pairs = [_stage_pair(p) for p in schedule]
    else:
        raise ValueError(f"schedule={schedule!r} must be a string 'LAYER:KEEP,...' or a list of (layer, keep) pairs.")
    if not pairs:
        raise ValueError(f"schedule={schedule!r} has no LAYER:KEEP stage; give one, e.g. schedule='2:0.25', or "
                         "leave schedule unset (None) for the method's own schedule.")
    return tuple(Stage(stage_layer(layer, f"layer of schedule entry {(layer, keep)!r}"),
                       check_keep(keep, f"keep of schedule entry {(layer, keep)!r}")) for layer, keep in pairs)


def _stage_pair(item: Any) -> tuple[Any, Any]:
    """``(layer, keep)`` of one schedule entry given as a :class:`Stage` or a pair."""
    if isinstance(item, Stage):
        return item.layer, item.keep
    if isinstance(item, list | tuple) and len(item) == 2:
        return item[0], item[1]
    raise ValueError(f"schedule entry {item!r} must be a (layer, keep) pair, e.g. [(2, 0.5), (8, 0.25)].")


def stage_layer(value: Any, name: str = "layer") -> int:
    """``value`` as a decoder-layer index: an integer (``int``, NumPy or torch integer scalars) or an integral
    number (``2.0``, ``np.float32(2)``); ``1.7``, ``True``, ``'2'`` are refused."""
    scalar = not getattr(value, "ndim", 0)  # not a tensor / array with elements along a dimension
    if scalar and not isinstance(value, bool) and type(value).__name__ not in ("bool_", "bool"):  # np.True_ too
        try:
            return operator.index(value)
        except TypeError:
            pass
        if isinstance(value, numbers.Real) and math.isfinite(float(value)) and float(value).is_integer():
            return int(value)
    raise ValueError(f"{name} must be an integer decoder-layer index, got {value!r}; e.g. 2.")


def validate_stages(stages: tuple[Stage, ...], num_layers: int) -> None:
    """Raise ``ValueError`` unless layers increase strictly inside the model and keep fractions decrease."""
    if not stages:
        raise ValueError("the schedule is empty; give at least one LAYER:KEEP stage, e.g. '2:0.25'.")
    previous_layer, previous_keep = -1, 1.0
    for stage in stages:
        if not 0 <= stage.layer < num_layers:
            raise ValueError(
                f"pruning layer {stage.layer} is outside the language model, which has {num_layers} decoder "
                f"layers; use a layer in [0, {num_layers - 1}]."
            )
        if stage.layer <= previous_layer:
            raise ValueError(f"schedule layers must increase strictly, got {stage.layer} after {previous_layer}.")
        check_keep(stage.keep, name=f"keep of the stage at layer {stage.layer}")
        if stage.keep > previous_keep:
            raise ValueError(
                f"keep must not grow along the schedule (got {stage.keep} after {previous_keep} at layer "
                f"{stage.layer}); keep fractions are relative to the original visual tokens."
            )
        previous_layer, previous_keep = stage.layer, stage.keep


def plain_number(value: Any) -> Any:
    """``value`` as a Python ``int`` / ``float`` when it is a number of another kind: a NumPy scalar
    (``np.int64(3)`` -> 3, ``np.float32(0.5)`` -> 0.5) or a 0-d tensor / array of a numeric dtype
    (``torch.tensor(0.5)`` -> 0.5). Anything else is returned unchanged for the caller's check to judge: bools
    of every kind (``True``, ``np.True_``, ``torch.tensor(True)``), strings, tensors with elements."""
    if isinstance(value, bool | int | float | str | bytes):
        return value
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        try:
            item = value.item()
        except (TypeError, ValueError, RuntimeError):
            return value
        if isinstance(item, int | float) and not isinstance(item, bool):
            return item
    return value


def _plain_numbers(value: Any) -> Any:
    """:func:`plain_number` of a value or of each item of a list / tuple of values."""
    if type(value) in (list, tuple):
        return type(value)(plain_number(item) for item in value)
    return plain_number(value)


def check_keep(keep: Any, name: str = "keep") -> float:
    """Return ``keep`` as a float or raise ``ValueError`` if it is not a number in ``(0, 1]``.

    Numbers of any kind are numbers (:func:`plain_number`: NumPy scalars, 0-d tensors); bools of any kind
    (``True`` would read as 1.0) and strings (``'0.25'``) are refused."""
    value = plain_number(keep)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in (0, 1], got {keep!r} ({type(keep).__name__}); e.g. keep=0.25.")
    value = float(value)
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(
            f"{name} must be in (0, 1] (the fraction of visual tokens kept), got {keep!r}; "
            "e.g. keep=0.25 keeps a quarter of them."
        )
    return value


@dataclass(frozen=True)
class PruneConfig:
    """What to prune and how much (frozen: derive a changed copy with ``dataclasses.replace(config, keep=0.5)``).

    Parameters
    ----------
    method: name of a preset from :func:`vtprune.list_methods` (``"fastv"``, ``"pdrop"``, ...).
        ``"fastv+debias"`` is shorthand for ``method="fastv", debias=True``.
    keep: final fraction of visual tokens kept, in ``(0, 1]``.
    schedule: optional explicit stages (``"2:0.5,8:0.25"``); otherwise the method's default schedule
        for this model depth, ending at ``keep``.
    layer: optional single pruning layer, shorthand for ``schedule=f"{layer}:{keep}"``.
    positions: ``"original"`` (kept tokens keep their position ids; default) or ``"compact"``.
    logits: layout of the outputs of a pruned prefill. ``"input"`` (default): one row per input token, as the
        unwrapped model (text positions exact, pruned visual positions NaN, padding 0); ``"pruned"``: one row
        per kept token, ``output.kept_positions`` ``[B, L_kept]`` gives each row's input position
        (:mod:`vtprune.outputs`).
    rounding: ``"sample"`` (default): a stage keeps ``keep_count(keep, N0)`` of a sample's ``N0`` visual tokens;
        ``"per_image"``: it keeps ``sum_g keep_count(keep, n_g)`` over the sample's images and video frames
        (temporal patches) ``g``, the count the vLLM plugin fixes per item before the tower
        (:meth:`vtprune.plan.Plan.kept_counts`).
    parity: ``"default"`` (vtprune's rules) or ``"release"``: the method's released count rounding, position
        policy and debiasing patch, for token-for-token reproduction (:mod:`vtprune.methods.release`).
    debias: ``False``, ``True`` (the model's calibration or the default trend) or a calibration file path.
    seed: seed of the ``random`` method.
    options: method-specific options (e.g. ``{"alpha": 0.5}``).
    """

    method: str = "fastv"
    keep: float = 0.25
    schedule: str | list | tuple | None = None
    layer: int | None = None
    positions: str = "original"
    debias: bool | str = False
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    parity: str = "default"
    logits: str = "input"
    rounding: str = "sample"

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"method must be a method name such as 'fastv', got {self.method!r}.")
        method, debias = split_method_name(self.method)
        keep = check_keep(self.keep)
        if self.positions not in ("original", "compact"):
            raise ValueError(f"positions must be 'original' or 'compact', got {self.positions!r}.")
        if self.logits not in LOGITS_LAYOUTS:
            raise ValueError(f"logits must be 'input' (one row per input token, the default) or 'pruned' (one row "
                             f"per kept token, mapped by output.kept_positions), got {self.logits!r}.")
        if self.parity not in ("default", "release"):
            raise ValueError(f"parity must be 'default' (vtprune's rules) or 'release' (the method's released code), "
                             f"got {self.parity!r}.")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be 'sample' (keep_count over a sample's visual tokens, the default) or "
                             f"'per_image' (keep_count per image / video frame, summed; the vLLM plugin's count), "
                             f"got {self.rounding!r}.")
        if self.layer is not None and self.schedule is not None:
            raise ValueError("give either layer=K or schedule='K:KEEP,...', not both.")
        stages = parse_schedule(self.schedule)
        if self.layer is not None:
            stages = (Stage(stage_layer(self.layer, "layer (the first decoder layer that sees pruned tokens)"), keep),)
        if stages is not None:
            keep = stages[-1].keep
        # The normalised values (frozen: set once, here); ``stages`` is derived, not a field. NumPy / 0-d tensor
        # numbers among the seed and the method options become Python numbers (the methods' checks refuse bools).
        options = self.options
        if isinstance(options, dict):
            options = {key: _plain_numbers(value) for key, value in options.items()}
        for name, value in (("method", method), ("debias", self.debias or debias), ("keep", keep),
                            ("stages", stages), ("seed", plain_number(self.seed)), ("options", options)):
            object.__setattr__(self, name, value)
