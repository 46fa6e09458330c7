"""Validation of debias calibration files (``vtprune calibrate`` output) at load time.

:func:`load_calibration_json` reads the file and :func:`check_calibration` checks every field the debiaser
uses, so a malformed file fails when it is loaded (``debias=FILE``, ``--debias FILE``, a method config
naming it) with a :class:`~vtprune.errors.UserError` that names the file and the field, not later inside
``generate``. Checked: ``format``, ``layers`` (keys are layer indices; ``sigma`` finite with
``|sigma| <= MAX_SIGMA``; ``mu`` finite and positive; a ``curve`` with ``x`` strictly increasing in
``[0, 1]`` and positive finite ``mean`` values of the same length), ``trend``, ``tau`` and, where the model
is known, ``model_type`` and the deepest layer (a file fitted on another model type or a deeper model is
refused, as PrefixKV profiles are).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vtprune.errors import UserError

MAX_SIGMA = 20.0  # exp(20) ~ 5e8 between the first and the last visual token; fitted values are about 0..3
TRENDS = ("exp", "curve")


def load_calibration_json(path: str | Path, form: str, model_type: str | None = None,
                          num_layers: int | None = None) -> dict[str, Any]:
    """The checked JSON object of calibration file ``path`` (``form`` is the expected ``format`` value; with
    ``model_type`` / ``num_layers``, a file fitted on another model type or a deeper model is refused)."""
    name = str(path)
    file = Path(path)
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise UserError(f"calibration file {name!r} {what}; create one with `vtprune calibrate --out FILE`.")
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{name} is not a vtprune debias calibration file (not valid JSON: "
                        f"{getattr(error, 'msg', None) or error}); create one with `vtprune calibrate`.") from error
    if not isinstance(data, dict) or data.get("format") != form or "layers" not in data:
        raise UserError(f"{name} is not a vtprune debias calibration file; create one with `vtprune calibrate`.")
    check_calibration(data, name)
    check_model(data, name, model_type, num_layers)
    return data


def check_model(data: dict[str, Any], name: str, model_type: str | None, num_layers: int | None = None) -> None:
    """Refuse a calibration fitted on another model type (its ``model_type`` field, when it has one) or one with
    layers beyond the model's ``num_layers`` decoder layers (a deeper model of the same type)."""
    fitted = data.get("model_type")
    fix = "fit one on this model with `vtprune calibrate --model PATH --out FILE`"
    if model_type is not None and fitted is not None and fitted != model_type:
        raise UserError(f"calibration file {name!r}: field 'model_type' is {fitted!r}, but the model is a "
                        f"{model_type!r}; {fix}.")
    deepest = max((int(key) for key in data["layers"]), default=-1)
    if num_layers is not None and deepest >= num_layers:
        raise UserError(f"calibration file {name!r}: field 'layers.{deepest}' is beyond the model's {num_layers} "
                        f"decoder layers (fitted on a deeper model?); {fix}.")


def check_calibration(data: dict[str, Any], name: str) -> None:
    """Raise :class:`UserError` naming ``name`` and the field for anything the debiaser cannot use."""
    trend = data.get("trend", "exp")
    _require(trend in TRENDS, name, "trend", f"must be one of {', '.join(TRENDS)}, got {trend!r}")
    tau = data.get("tau", 0.5)
    _require(_finite(tau) and 0.0 <= tau <= 1.0, name, "tau", f"must be a number in [0, 1], got {tau!r}")
    layers = data["layers"]
    _require(isinstance(layers, dict) and layers, name, "layers",
             "must be a non-empty object of {layer index: fit}")
    for key, entry in layers.items():
        _check_layer(key, entry, name, trend)


def _check_layer(key: Any, entry: Any, name: str, trend: str) -> None:
    where = f"layers.{key}"
    _require(isinstance(key, str) and key.strip().isdigit(), name, where, "must be keyed by a layer index >= 0")
    _require(isinstance(entry, dict), name, where, f"must be an object with sigma / mu / curve, got {entry!r}")
    curve = entry.get("curve")
    if curve is not None:
        _check_curve(curve, name, f"{where}.curve")
    if trend == "curve" and curve:
        return
    _require("sigma" in entry, name, f"{where}.sigma", "is missing (the fitted exponent of the trend)")
    sigma = entry["sigma"]
    _require(_finite(sigma), name, f"{where}.sigma", f"must be a finite number, got {sigma!r}")
    _require(abs(sigma) <= MAX_SIGMA, name, f"{where}.sigma",
             f"is {sigma!r}, beyond +-{MAX_SIGMA:g} (fitted values are about 0..3); refit with `vtprune calibrate`")
    mu = entry.get("mu", 1.0)
    _require(_finite(mu) and mu > 0, name, f"{where}.mu", f"must be a finite number > 0, got {mu!r}")


def _check_curve(curve: Any, name: str, where: str) -> None:
    _require(isinstance(curve, dict), name, where, f"must be an object with 'x' and 'mean' lists, got {curve!r}")
    xs, ys = curve.get("x"), curve.get("mean")
    for field, values in (("x", xs), ("mean", ys)):
        _require(isinstance(values, list) and values and all(_finite(v) for v in values), name,
                 f"{where}.{field}", f"must be a non-empty list of finite numbers, got {_short(values)}")
    _require(len(xs) == len(ys), name, where, f"'x' has {len(xs)} values but 'mean' has {len(ys)}")
    _require(all(b > a for a, b in zip(xs, xs[1:])), name, f"{where}.x",
             f"must increase strictly (sorted bin centres), got {_short(xs)}")
    _require(0.0 <= xs[0] and xs[-1] <= 1.0, name, f"{where}.x", f"must lie in [0, 1], got {_short(xs)}")
    _require(all(v > 0 for v in ys), name, f"{where}.mean", f"must be positive (mean attention), got {_short(ys)}")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _require(condition: Any, name: str, field: str, problem: str) -> None:
    if not condition:
        raise UserError(f"calibration file {name!r}: field {field!r} {problem}.")
