"""The pruning options of ``vtprune run`` (image and video): arguments, and what they resolve to.

``--method`` and ``--keep`` default to None so that a ``--config`` file (from ``vtprune tune``) can supply
them; a value given both on the command line and in the file must agree, otherwise the run stops before any
work with an error naming the file and the field. No torch at import.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from vtprune.cli.checks import ATTN_IMPLEMENTATIONS, DTYPE_NAMES, int_range, keep_fraction
from vtprune.errors import UserError

DEFAULT_METHOD = "fastv"
DEFAULT_KEEP = 0.25
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def add_pruning_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that prunes shares (model, method, keep, schedule, attention)."""
    parser.add_argument("--model", default=None,
                        help="model folder or hub id (e.g. llava-hf/llava-1.5-7b-hf); default 'embedded:llava' "
                             "(images) or 'embedded:qwen2_vl' (--video); 'tiny:<type>' is a random test model")
    parser.add_argument("--method", default=None,
                        help="pruning method, see `vtprune info` (default fastv, or the --config file's); "
                             "add '+debias' for debiased attention scores, e.g. fastv+debias")
    parser.add_argument("--keep", type=keep_fraction, default=None,
                        help="fraction of the visual tokens kept, in (0, 1] (default 0.25, or the --config "
                             "file's; a --schedule's last stage wins)")
    parser.add_argument("--layer", type=int_range(0), default=None,
                        help="prune once, before decoder layer K (0 = before the LM; default: the method's own)")
    parser.add_argument("--schedule", default=None,
                        help="progressive stages LAYER:KEEP,... with keep fractions of the original tokens, e.g. "
                             "'1:0.5,3:0.25' (the embedded LMs have 4 layers; 7B models 32: '2:0.5,8:0.25'); "
                             "default: the method's own")
    parser.add_argument("--config", default=None,
                        help="method configuration file written by `vtprune tune` (default: none)")
    parser.add_argument("--debias", default=None,
                        help="debias attention scores: 'true' (the model's calibration.json, else the default "
                             "trend), 'false', or a file from `vtprune calibrate` (default: off)")
    parser.add_argument("--parity", default=None, choices=("default", "release"),
                        help="'release': the method's released code's rules (count truncation, position "
                             "compaction, debias defaults) to reproduce a paper's table token for token; "
                             "see docs/methods.md (default: vtprune's rules)")
    parser.add_argument("--rounding", default=None, choices=("sample", "per_image"),
                        help="'per_image': each image (and video temporal patch) keeps keep_count(keep, n_i), "
                             "summed per prompt, as the vLLM plugin counts; see docs/serving.md (default: "
                             "'sample', keep_count over the prompt's visual tokens)")
    parser.add_argument("--attn", default="sdpa", choices=ATTN_IMPLEMENTATIONS,
                        help="attn_implementation the model runs with (flash_attention_2: CUDA and flash-attn)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                        help="weights dtype (float16 / bfloat16 on GPUs; auto: the checkpoint's)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")


@dataclass
class Pruning:
    """What ``vtprune.wrap`` gets: method, requested keep, options; ``notes`` explain overrides."""

    method: str
    keep: float
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    asked: float | None = None  # the keep given by --keep or the --config file (None: the default was used)


def pruning_choice(args: argparse.Namespace) -> Pruning:
    """Resolve ``--method/--keep/--layer/--schedule/--debias/--config``; :class:`UserError` on conflicts."""
    given = {"layer": args.layer, "schedule": args.schedule or None, "parity": getattr(args, "parity", None),
             "rounding": getattr(args, "rounding", None)}
    if getattr(args, "debias", None) is not None:
        given["debias"] = debias_option(args.debias)
    given = {k: v for k, v in given.items() if v is not None}
    if args.method is not None and not args.method.strip():
        raise UserError("--method is empty; name a method, e.g. --method fastv (`vtprune info` lists them).")
    if args.schedule is not None and not args.schedule.strip():
        raise UserError("--schedule is empty; give stages LAYER:KEEP,..., e.g. --schedule 1:0.5,3:0.25, or drop it.")
    if args.schedule:
        from vtprune.config import parse_schedule, validate_stages

        try:
            validate_stages(parse_schedule(args.schedule), 1 << 20)  # the depth is checked with the model
        except ValueError as error:
            raise UserError(f"--schedule {args.schedule!r}: {error}") from error
    method, keep, options = args.method, args.keep, dict(given)
    if getattr(args, "config", None):
        method, keep, options = _merge_config(args, given)
    choice = Pruning(method or DEFAULT_METHOD, DEFAULT_KEEP if keep is None else keep, options, asked=keep)
    _schedule_note(choice, args.keep)
    check_pruning(choice)
    return choice


def check_pruning(choice: Pruning) -> None:
    """Method name, its options and the schedule syntax, checked without a model (depth is checked at wrap)."""
    from vtprune.config import PruneConfig, validate_stages
    from vtprune.methods import resolve
    from vtprune.plan import check_rounding

    config_keys = ("schedule", "layer", "positions", "debias", "seed", "parity", "rounding")
    fields = {k: v for k, v in choice.options.items() if k in config_keys}
    method_options = {k: v for k, v in choice.options.items() if k not in config_keys}
    try:
        config = PruneConfig(method=choice.method, keep=choice.keep, options=method_options, **fields)
        if config.stages:
            validate_stages(config.stages, 1 << 20)  # order and keep fractions now; the depth at wrap time
        scorer = resolve(config.method, method_options, debias=config.debias)
        check_rounding(config, scorer)
        if config.parity == "release":
            from vtprune.methods.release import methods_with_rules, release_rule, with_release_options

            rule = release_rule(scorer)
            if rule is None:
                raise UserError(f"--parity release is not available for --method {choice.method}: vtprune has no "
                                f"release rule for it (methods with one: {', '.join(methods_with_rules())}); "
                                "drop --parity.")
            with_release_options(scorer, rule)  # the release's method options, checked with the user's
    except UserError:
        raise
    except ValueError as error:
        raise UserError(str(error)) from error


def _merge_config(args: argparse.Namespace, given: dict[str, Any]) -> tuple[str | None, float | None, dict]:
    from vtprune.method_config import read_method_config

    file = read_method_config(args.config, method=args.method or DEFAULT_METHOD)
    where = f"--config {args.config!r}"
    method = args.method
    if file.method and method and file.method.split("+")[0] != method.split("+")[0]:
        raise UserError(f"--method {method!r} but {where} is a configuration of {file.method!r} (field 'method'); "
                        f"drop --method or use --method {file.method}.")
    options = dict(file.options)
    keep = options.pop("keep", None)
    if keep is not None and args.keep is not None and float(keep) != args.keep:
        raise UserError(f"--keep {args.keep:g} but {where} sets keep {keep!r} (field 'keep'); drop one of them.")
    for key, value in given.items():
        if key in options and options[key] != value:
            raise UserError(f"--{key} {value!r} but {where} sets {key} = {options[key]!r}; drop one of them.")
    if ("layer" in given and options.get("schedule")) or ("schedule" in given and options.get("layer") is not None):
        raise UserError(f"{where} sets a {'schedule' if 'layer' in given else 'layer'} and the command line a "
                        f"{'layer' if 'layer' in given else 'schedule'}; give one of them.")
    options.update(given)
    return method or file.method, args.keep if args.keep is not None else keep, options


def debias_option(value: str) -> bool | str:
    """``--debias``: true / false words, or a calibration file (checked now, before any model is loaded)."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    from vtprune.methods.debias import check_debias_option

    try:
        return check_debias_option(value)
    except UserError:
        raise
    except ValueError as error:
        raise UserError(f"--debias {value!r}: {error}") from error


def _schedule_note(choice: Pruning, requested: float | None) -> None:
    """Say when an explicit --keep is overridden by the last stage of a schedule."""
    schedule = choice.options.get("schedule")
    if requested is None or not schedule:
        return
    from vtprune.config import parse_schedule

    try:
        stages = parse_schedule(schedule)
    except ValueError as error:
        raise UserError(f"--schedule {schedule!r}: {error}") from error
    if stages and stages[-1].keep != requested:
        choice.notes.append(f"--keep {requested:g} is overridden by the schedule's last stage "
                            f"(keep {stages[-1].keep:g} from layer {stages[-1].layer}).")


def keep_label(keep: float, asked: float | None, options: dict[str, Any]) -> str:
    """``keep=0.25``, plus what was asked when the final keep differs (a schedule) and a budget if one rules."""
    label = f"keep={keep:.3g}"
    if asked is not None and asked != keep:
        label += f" (asked {asked:g})"
    if options.get("budget") is not None:
        label += f", average budget {float(options['budget']):g} over the layers"
    return label


def final_keep(choice: Pruning) -> float:
    """The keep fraction the last stage applies: a schedule's last keep, else the requested keep."""
    schedule = choice.options.get("schedule")
    if not schedule:
        return choice.keep
    from vtprune.config import parse_schedule

    stages = parse_schedule(schedule)
    return stages[-1].keep if stages else choice.keep


def effective_stages(handle: Any) -> list[list[float]]:
    """``[[layer, keep], ...]`` of a wrapped model's handle (empty when nothing is pruned)."""
    return [[int(stage.layer), float(stage.keep)] for stage in getattr(handle, "stages", ()) or ()]


def effective_keep(handle: Any) -> float:
    """The final keep fraction the handle applies: the last stage's; a KV-retention method's (``prefixkv``, no
    stages: each layer's cache keeps ``keep`` on average) its ``keep``; 1.0 when nothing is pruned."""
    stages = effective_stages(handle)
    if stages:
        return stages[-1][1]
    return float(handle.config.keep) if getattr(handle, "retains_kv", False) else 1.0


def check_depth(choice: Pruning, spec: str | None) -> None:
    """An explicit ``--schedule`` / ``--layer`` against the model's depth (read from its config), before loading."""
    from vtprune.config import Stage, parse_schedule, validate_stages
    from vtprune.models.loading import text_layers

    schedule, layer = choice.options.get("schedule"), choice.options.get("layer")
    if not schedule and layer is None:
        return
    layers = text_layers(spec)
    if layers is None:
        return
    stages = parse_schedule(schedule) if schedule else (Stage(int(layer), choice.keep),)
    flag = f"--schedule {schedule!r}" if schedule else f"--layer {layer}"
    try:
        validate_stages(stages, layers)
    except ValueError as error:
        raise UserError(f"{flag}: {error}") from error


def debias_source(handle: Any) -> str | None:
    """What debiases the handle's attention scores: a calibration file, 'default trend', or None (no debias)."""
    from vtprune.methods import Debiased
    from vtprune.methods.debias import DEFAULT_SIGMA

    scorer = getattr(handle, "scorer", None)
    while scorer is not None and not isinstance(scorer, Debiased):
        scorer = getattr(scorer, "inner", None)
    if scorer is None:
        return None
    source = scorer.debiaser.source
    return f"default trend (sigma {DEFAULT_SIGMA:g})" if source == "default" else f"calibration {source}"
