"""Method configuration files (written by ``vtprune tune``): read and validated at load time.

A file is a JSON object: either the output of ``vtprune tune`` (``{"method": ..., "wrap_options": {...}, ...}``)
or a hand-written object of :func:`vtprune.wrap` keyword options (``{"schedule": "2:0.5,8:0.25"}``). Every
problem is a :class:`~vtprune.errors.UserError` that names the file and the field, raised before a model is
loaded: unreadable JSON, a non-object, unknown method, option values of the wrong type, non-finite numbers
(``NaN``, ``Infinity``), bad keep fractions or schedules, missing debias calibration files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from vtprune.config import check_keep, parse_schedule, split_method_name, stage_layer, validate_stages
from vtprune.errors import UserError
from vtprune.methods import METHODS, list_methods, resolve
from vtprune.methods.debias import read_calibration
from vtprune.methods.registry import option_names

CONFIG_FIELDS = ("schedule", "layer", "positions", "debias", "seed")


@dataclass
class MethodConfigFile:
    """A validated method configuration: its ``method`` (None if the file names none) and wrap options.

    ``options`` are :func:`vtprune.wrap` keyword arguments; they may hold ``keep`` when the file sets it.
    """

    path: str
    method: str | None
    options: dict[str, Any] = field(default_factory=dict)


def read_method_config(path: str | Path, method: str | None = None) -> MethodConfigFile:
    """Read and check ``path``; ``method`` (when the file names none) is the method its options are checked for."""
    name = str(path)
    data = _read_json(Path(path), name)
    options = data.get("wrap_options", data) if "wrap_options" in data else dict(data)
    if not isinstance(options, dict):
        raise UserError(f"method config {name!r}: field 'wrap_options' must be a JSON object of wrap() options, "
                        f"got {type(options).__name__}.")
    prefix = "wrap_options." if "wrap_options" in data else ""
    options = dict(options)
    inner = options.pop("method", None)
    outer = data.get("method") if prefix else None
    file_method = _check_method_names(name, outer, inner, prefix)
    _check_finite(options, name, prefix)
    _check_config_fields(options, name, prefix, Path(path))
    chosen = file_method or method
    if chosen:
        _check_method_options(chosen, options, name, prefix)
    return MethodConfigFile(name, file_method, options)


def _read_json(file: Path, name: str) -> dict[str, Any]:
    if not file.exists():
        raise UserError(f"method config {name!r} does not exist; create it with `vtprune tune ... --out FILE`.")
    if file.is_dir():
        raise UserError(f"method config {name!r} is a folder; give the JSON file written by `vtprune tune`.")
    try:
        data = json.loads(file.read_text())
    except UnicodeDecodeError as error:
        raise UserError(f"method config {name!r} is not a text (JSON) file ({error.reason}).") from error
    except json.JSONDecodeError as error:
        raise UserError(f"method config {name!r} is not valid JSON: {error.msg} at line {error.lineno}, column "
                        f"{error.colno}.") from error
    if not isinstance(data, dict):
        raise UserError(f"method config {name!r} must hold a JSON object of wrap() options, got "
                        f"{type(data).__name__}.")
    return data


def _check_method_names(name: str, outer: Any, inner: Any, prefix: str) -> str | None:
    """The file's method (top-level ``method`` of a tune file, or ``method`` among the options)."""
    known = list_methods()
    for key, value in (("method", outer), (f"{prefix}method", inner)):
        if value is None:
            continue
        if not isinstance(value, str) or _base(value) not in known:
            raise UserError(f"method config {name!r}: field {key!r} must be one of {', '.join(known)}, got {value!r}.")
    if outer is not None and inner is not None and outer != inner:
        raise UserError(f"method config {name!r}: fields 'method' ({outer!r}) and {prefix + 'method'!r} ({inner!r}) "
                        "disagree; keep one.")
    return outer if outer is not None else inner


def _check_finite(value: Any, name: str, where: str) -> None:
    """Refuse NaN / Infinity anywhere in the options (JSON readers accept them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"method config {name!r}: field {where.rstrip('.')!r} is {value}; give a finite number.")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, name, f"{where}{key}.")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_finite(item, name, f"{where.rstrip('.')}[{index}].")


def _check_config_fields(options: dict[str, Any], name: str, prefix: str, file: Path) -> None:
    """Types and values of ``keep`` and the :class:`vtprune.PruneConfig` fields among the options."""

    where = f"method config {name!r}: field"
    if "keep" in options:
        _require(_is_number(options["keep"]), f"{where} '{prefix}keep' must be a number in (0, 1], got {options['keep']!r}.")
        _as_user(lambda: check_keep(options["keep"]), f"{where} '{prefix}keep'")
    if options.get("layer") is not None:
        layer = _as_user(lambda: stage_layer(options["layer"]), f"{where} '{prefix}layer'")
        _require(layer >= 0, f"{where} '{prefix}layer' must be a decoder layer index >= 0, got {options['layer']!r}.")
    if options.get("schedule") not in (None, ""):
        stages = _as_user(lambda: parse_schedule(options["schedule"]), f"{where} '{prefix}schedule'")
        _as_user(lambda: validate_stages(stages, 1 << 20), f"{where} '{prefix}schedule'")
        if options.get("layer") is not None:
            raise UserError(f"{where}s '{prefix}layer' and '{prefix}schedule' are both set; keep one.")
    if "positions" in options:
        _require(options["positions"] in ("original", "compact"),
                 f"{where} '{prefix}positions' must be 'original' or 'compact', got {options['positions']!r}.")
    if "seed" in options:
        _require(_is_int(options["seed"]), f"{where} '{prefix}seed' must be an integer, got {options['seed']!r}.")
    if "debias" in options:
        options["debias"] = _debias_value(options["debias"], f"{where} '{prefix}debias'", file)


def _debias_value(value: Any, where: str, file: Path) -> bool | str:
    """``True`` / ``False`` or an existing calibration file (relative paths: to the working folder, then the config)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str) or not value:
        raise UserError(f"{where} must be true, false or a calibration file path, got {value!r}.")
    candidates = [Path(value), file.parent / value]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise UserError(f"{where}: calibration file {value!r} does not exist; create it with `vtprune calibrate`.")
    _as_user(lambda: read_calibration(found), where)
    return str(found)


def _check_method_options(method: str, options: dict[str, Any], name: str, prefix: str) -> None:
    """Option types against the method's dataclass fields, then the method's own constructor checks."""
    base = _base(method)
    factory = METHODS.get(base)
    if factory is not None and is_dataclass(factory):
        known = {f.name: str(f.type) for f in fields(factory)}
    else:
        known = {option: "" for option in option_names(base)} if factory is not None else {}
    method_options = {k: v for k, v in options.items() if k not in (*CONFIG_FIELDS, "keep")}
    for key, value in method_options.items():
        if factory is not None and key not in known:
            raise UserError(f"method config {name!r}: field '{prefix}{key}' is not an option of {base} (its options: "
                            f"{', '.join(known) or 'none'}; wrap() also takes keep, {', '.join(CONFIG_FIELDS)}).")
        if known.get(key) and not _matches(value, known[key]):
            raise UserError(f"method config {name!r}: field '{prefix}{key}' of {base} must be {known[key]}, "
                            f"got {value!r}.")
    _as_user(lambda: resolve(base, method_options), f"method config {name!r} ({base})")


def _base(method: str) -> str | None:
    """The method name without its ``+debias`` suffix, or None for a malformed name."""
    try:
        return split_method_name(method)[0]
    except ValueError:
        return None


def load_method_config(path: str) -> dict[str, Any]:
    """Options saved by ``vtprune tune`` (a JSON object of :func:`vtprune.wrap` keyword arguments), validated.

    Wrong types, non-finite numbers, bad keep fractions / schedules and options the file's method does not
    take raise :class:`vtprune.errors.UserError` naming the file and the field, at load time. The file's
    ``method`` is not among the returned options: :func:`read_method_config` gives it.
    """
    return read_method_config(path).options


def _matches(value: Any, annotation: str) -> bool:
    """Does ``value`` fit a dataclass annotation string such as ``'float | None'`` (unknown parts accept)?"""
    checks = {"int": _is_int, "float": _is_number, "bool": lambda v: isinstance(v, bool),
              "str": lambda v: isinstance(v, str), "None": lambda v: v is None,
              "list": lambda v: isinstance(v, list), "tuple": lambda v: isinstance(v, list),
              "dict": lambda v: isinstance(v, dict)}
    for part in annotation.split("|"):
        token = part.strip().split("[")[0]
        if token not in checks or checks[token](value):
            return True
    return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def _as_user(check: Any, where: str) -> Any:
    """Run ``check()``; a ``ValueError`` it raises becomes a :class:`UserError` prefixed with ``where``."""
    try:
        return check()
    except UserError as error:
        raise UserError(f"{where}: {error}") from error
    except (ValueError, TypeError) as error:
        raise UserError(f"{where}: {error}") from error
