"""``--model_args`` of the vtprune lmms-eval models: parsing and validation before anything is loaded.

lmms-eval turns ``--model_args a=1,b=x`` into keyword arguments (numbers and ``true``/``false`` converted,
commas split the pairs), so a progressive schedule is written with ``;``: ``schedule=2:0.5;8:0.25``.

Keys read here (everything else is a method option, e.g. ``alpha=0.5``, checked by :func:`vtprune.wrap`):

==========================  ===========================================================================
``pretrained``              folder, hub id, ``embedded:llava`` / ``tiny:<model_type>``; default: the
                            embedded LLaVA
``method``, ``keep``        as in :func:`vtprune.wrap` (default ``fastv``, ``0.25``)
``schedule``, ``layer``     progressive stages (``2:0.5;8:0.25``) or a single pruning layer
``debias``                  ``true`` / ``false`` / a calibration file
``positions``, ``seed``     :class:`vtprune.PruneConfig` fields
``config``                  a method configuration file written by ``vtprune tune``
``attn_implementation``     ``sdpa`` (default), ``eager``, ``flash_attention_2``
``dtype``                   ``float32`` (default), ``float16``, ``bfloat16``, ``auto``
``device``                  ``cpu``, ``cuda``, ``cuda:1`` (default: CUDA when available); one device per rank
                            under ``accelerate launch``
``batch_size``              requests per ``generate`` call (also lmms-eval's ``--batch_size``)
``max_pixels``/``min_pixels``  Qwen-VL image processor resolution bounds
``threads``                 ``torch.set_num_threads`` (CPU runs)
``image_aspect_ratio``      ``original`` (default: the processor's resize and centre crop) or ``pad``: each
                            image padded to a square with the image processor's mean colour first, as
                            LLaVA-1.5's own evaluation does (``expand2square``); LLaVA-1.5 checkpoints only
``image_backend``           ``default`` (transformers' choice: its torchvision image processor where
                            torchvision is installed) or ``pil``: the PIL image processor, whose resize is
                            the one the original LLaVA code ran (``vtprune bench reproduce`` asks for it)
``loglikelihood``           what ``loglikelihood`` returns: ``loss`` (default; the mean negative
                            log-likelihood per continuation token, lower is more likely, as lmms-eval's own
                            models return and its ``multiple_choice`` scoring expects: it takes the argmin)
                            or ``logprob`` (the summed log-probability, as lmms-eval's API docstring says)
==========================  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOAD_KEYS = ("pretrained", "attn_implementation", "dtype", "device")
CONFIG_FIELDS = ("schedule", "layer", "positions", "debias", "seed")
RUN_KEYS = ("batch_size", "max_batch_size", "max_pixels", "min_pixels", "threads", "loglikelihood",
            "image_aspect_ratio", "image_backend")
LOGLIKELIHOOD_KINDS = ("loss", "logprob")  # vtprune.eval.lmms_plugin.loglikelihood
ASPECT_RATIOS = ("original", "pad")
IMAGE_BACKENDS = ("default", "pil")


@dataclass
class PluginArgs:
    """Validated ``--model_args``: what to load, how to prune (a :class:`vtprune.PruneConfig`), how to run."""

    prune: Any
    pretrained: str | None = None
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    device: str | None = None
    batch_size: int = 1
    max_pixels: int | None = None
    min_pixels: int | None = None
    threads: int | None = None
    loglikelihood: str = "loss"
    image_aspect_ratio: str = "original"
    image_backend: str = "default"

    def describe(self) -> str:
        """One line for logs: method, keep and stages."""
        stages = ";".join(f"{s.layer}:{s.keep:g}" for s in self.prune.stages or ())
        debias = f",debias={self.prune.debias}" if self.prune.debias else ""
        return f"method={self.prune.method},keep={self.prune.keep:g}{debias}" + (f",schedule={stages}" if stages else "")


def parse_model_args(kwargs: dict[str, Any]) -> PluginArgs:
    """Validate ``kwargs`` (lmms-eval's parsed ``--model_args``) with vtprune's own checks; raise ``ValueError``.

    Checks everything that does not need the model (method name and options, keep, schedule syntax, config
    file, dtype, batch size), so a typo fails before a checkpoint is loaded. Layer bounds and model limits
    are checked by :func:`vtprune.wrap` right after loading.
    """
    from vtprune.models.loading import DTYPES

    rest = dict(kwargs)
    _map_device_map(rest)
    load = {k: rest.pop(k) for k in LOAD_KEYS if k in rest and rest[k] is not None}
    run = {k: rest.pop(k) for k in RUN_KEYS if k in rest and rest[k] is not None}
    prune = prune_config(rest)
    dtype = str(load.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)} in --model_args.")
    from vtprune.errors import UserError
    from vtprune.models.loading import check_load

    # A bad folder, an unreachable or offline hub id, a missing GPU or flash-attn fail now, in one line.
    try:
        check_load(_optional_str(load.get("pretrained")), _optional_str(load.get("device")),
                   str(load.get("attn_implementation", "sdpa")), dtype)
    except UserError as error:  # vtprune's loader names the CLI's --model; here the value came from pretrained=
        raise UserError(str(error).replace("--model ", "pretrained=")) from None  # one message, not two
    return PluginArgs(
        prune=prune, pretrained=_optional_str(load.get("pretrained")),
        attn_implementation=str(load.get("attn_implementation", "sdpa")), dtype=dtype,
        device=_optional_str(load.get("device")), batch_size=_positive_int("batch_size", run.get("batch_size", 1)),
        max_pixels=_optional_int("max_pixels", run.get("max_pixels")),
        min_pixels=_optional_int("min_pixels", run.get("min_pixels")),
        threads=_optional_int("threads", run.get("threads")),
        loglikelihood=_loglikelihood_kind(run.get("loglikelihood", "loss")),
        image_aspect_ratio=_aspect_ratio(run.get("image_aspect_ratio", "original")),
        image_backend=_image_backend(run.get("image_backend", "default")),
    )


def prune_config(options: dict[str, Any]) -> Any:
    """A checked :class:`vtprune.PruneConfig` from pruning keys; a ``config=`` file supplies the rest.

    A key set both in the file and in ``--model_args`` (``method``, ``keep``, an option) must agree: a clash
    is an error naming the file and the field. The method is instantiated once with its options, so an
    unknown name or option raises vtprune's ``ValueError`` here, before the model is loaded.
    """
    from vtprune.config import PruneConfig
    from vtprune.methods import resolve

    merged = _with_config_file(options)
    fields = {k: merged.pop(k) for k in CONFIG_FIELDS if k in merged}
    if fields.get("schedule") is not None:
        fields["schedule"] = str(fields["schedule"])
    config = PruneConfig(method=str(merged.pop("method", "fastv")), keep=merged.pop("keep", 0.25),
                         options=merged, **fields)
    resolve(config.method, config.options, debias=config.debias)
    return config


def _with_config_file(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` merged with the ``config=`` file's method and wrap options (clashes refused)."""
    from vtprune.errors import UserError
    from vtprune.method_config import read_method_config

    given = {k: v for k, v in options.items() if k != "config"}
    config_file = options.get("config")
    if not config_file:
        return given
    file = read_method_config(str(config_file), method=str(given.get("method", "fastv")))
    from_file = dict(file.options)
    if file.method is not None:
        from_file["method"] = file.method
    for key, value in given.items():
        if key in from_file and _differs(from_file[key], value):
            raise UserError(f"--model_args {key}={value!r} but config={config_file!r} sets {key} = "
                            f"{from_file[key]!r}; drop one of them.")
    return {**from_file, **given}


def _differs(a: Any, b: Any) -> bool:
    """Values from JSON and from lmms-eval's parser differ only in spelling (``0.25`` vs ``'0.25'``)?"""
    if a == b:
        return False
    if isinstance(a, str) and isinstance(b, str):
        return a.split("+")[0] != b.split("+")[0] if "+" in a + b else a != b
    try:
        return float(a) != float(b)
    except (TypeError, ValueError):
        return str(a).lower() != str(b).lower()


def _map_device_map(rest: dict[str, Any]) -> None:
    """Accept lmms-eval's ``device_map=`` spelling as ``device=`` (one device per process)."""
    if "device_map" not in rest:
        return
    value = rest.pop("device_map")
    if value in ("", None):
        return
    if rest.get("device") not in (None, "", value):
        raise ValueError(f"device={rest['device']!r} and device_map={value!r} disagree; pass only device=.")
    rest["device"] = str(value)


def _loglikelihood_kind(value: Any) -> str:
    if value not in LOGLIKELIHOOD_KINDS:
        raise ValueError(f"loglikelihood={value!r}: use loss (the default: mean negative log-likelihood per "
                         "continuation token, what lmms-eval's multiple_choice scoring expects) or logprob.")
    return str(value)


def _aspect_ratio(value: Any) -> str:
    if value not in ASPECT_RATIOS:
        raise ValueError(f"image_aspect_ratio={value!r}: use original (the processor's resize and centre crop, the "
                         "default) or pad (pad each image to a square with the processor's mean colour, as "
                         "LLaVA-1.5's own evaluation).")
    return str(value)


def _image_backend(value: Any) -> str:
    if value not in IMAGE_BACKENDS:
        raise ValueError(f"image_backend={value!r}: use default (transformers' choice) or pil (the PIL image "
                         "processor, as the original LLaVA code resized).")
    return str(value)


def _optional_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; e.g. {name}=8.") from err
    if number < 1 or str(number) != str(value).strip():
        raise ValueError(f"{name} must be a positive integer, got {value!r}; e.g. {name}=8.")
    return number


def _optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _positive_int(name, value)
