"""Load a model and its processor: the embedded default, a tiny random model, or any checkpoint.

``spec`` forms accepted everywhere a ``--model`` is taken:

* ``None`` / ``"embedded"`` / ``"embedded:llava"`` / ``"embedded:qwen2_vl"`` / ``"embedded:llava64"``: models
  shipped in the package;
* ``"tiny:<model_type>"``: a random tiny model built from config (tests, smoke runs);
* a local folder or a hub id (``llava-hf/llava-1.5-7b-hf``, ``Qwen/Qwen2.5-VL-7B-Instruct``): the real
  ``from_pretrained`` path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vtprune.adapters import ADAPTERS
from vtprune.errors import UserError
from vtprune.models.embedded import EMBEDDED_MODELS, MODELS_DIR, embedded_model_path
from vtprune.models.hub import hub_access
from vtprune.models.tiny import TINY_TYPES, no_video_processor, tiny_model

# transformers and huggingface_hub are imported inside the functions that load a model: importing them takes
# seconds, and `vtprune --help` and the argument checks must not pay that.

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


def resolve_model(spec: str | None) -> str:
    """The folder / hub id / ``tiny:`` spec that ``spec`` names (the embedded LLaVA by default)."""

    if spec in (None, "", "embedded"):
        return str(embedded_model_path("llava"))
    if spec.startswith("embedded:"):
        name = spec.split(":", 1)[1]
        if name not in EMBEDDED_MODELS:
            raise UserError(f"--model {spec!r}: no embedded model {name!r}; choose "
                            f"{', '.join('embedded:' + n for n in EMBEDDED_MODELS)}.")
        return str(embedded_model_path(name))
    return spec


def check_model_spec(spec: str | None) -> str:
    """``resolve_model(spec)``, refusing (before any loading) a spec that cannot name a loadable model.

    A ``tiny:`` type must exist; a path that exists must be a model folder (with ``config.json``); a value
    that looks like a path but does not exist is refused; a hub id must be in the local cache when the hub is
    offline (``HF_HUB_OFFLINE=1``) or cannot be reached (a probe of a few seconds, not 50 s of retries).
    """

    target = resolve_model(spec)
    if target.startswith("tiny:"):
        if target.split(":", 1)[1] not in TINY_TYPES:
            raise UserError(f"--model {spec!r}: no tiny model of that type; choose one of "
                            f"{', '.join('tiny:' + t for t in TINY_TYPES)}.")
        return target
    path = Path(target).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {spec!r} is not a model folder (no config.json in it); give a folder saved "
                            "with save_pretrained, a hub id, 'embedded:llava' or 'tiny:<type>'.")
        return str(path)
    if _looks_like_path(target) or not _is_hub_id(target):
        raise UserError(f"--model {spec!r}: no such folder, and not a hub id of the form ORG/NAME; give a model "
                        "folder, a hub id (e.g. llava-hf/llava-1.5-7b-hf), 'embedded:llava' or 'tiny:<type>'.")
    hub_access(target)
    return target


def _looks_like_path(target: str) -> bool:
    return target.startswith((".", "/", "~")) or "\\" in target or target.count("/") > 1 or target.endswith("/")


def _is_hub_id(target: str) -> bool:

    return re.fullmatch(r"[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?", target) is not None


def _local_only(target: str) -> bool:
    """Load ``target`` from disk only: a folder, or a hub id while the hub is offline or unreachable."""
    return Path(target).expanduser().exists() or hub_access(target)


def check_device(device: str | None) -> str:
    """The device to load on (CUDA when available by default); refuse one this machine does not have."""
    if device in (None, ""):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "auto":
        return device
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise UserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N.") from error
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device!r}: CUDA is not available here (torch {torch.__version__}, no GPU "
                            "visible); use --device cpu or leave --device out.")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UserError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {device!r}: MPS is not available here; use --device cpu.")
    return device


FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
                  "flash_attention_3": ("flash_attn_interface", "build flash-attention's hopper/ package (FA3)")}


def check_attention(attn_implementation: str, device: str | None) -> None:
    """Refuse a FlashAttention backend without its package or without a CUDA device (before loading)."""
    if attn_implementation not in FLASH_PACKAGES:
        return
    module, install = FLASH_PACKAGES[attn_implementation]
    if importlib.util.find_spec(module) is None:
        raise UserError(f"--attn {attn_implementation} needs the package {module!r}, which is not installed "
                        f"({install}; CUDA GPUs only); or use --attn sdpa.")
    resolved = check_device(device)
    if not resolved.startswith("cuda") and resolved != "auto":
        raise UserError(f"--attn {attn_implementation} runs on CUDA GPUs only, and the device is {resolved!r}; "
                        "use --attn sdpa here.")


def check_load(spec: str | None, device: str | None = None, attn_implementation: str = "sdpa",
               dtype: str = "float32") -> str:
    """Every check :func:`load` makes before reading weights (model, device, dtype, attention); the target."""
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    check_device(device)
    check_attention(attn_implementation, device)
    target = check_model_spec(spec)
    if not target.startswith("tiny:"):
        check_model_type(raw_config(target), spec)
    return target


def raw_config(target: str) -> dict[str, Any]:
    """``config.json`` of a folder or hub id as a dict, read without importing transformers (fast)."""
    path = Path(target).expanduser() / "config.json"
    try:
        if not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(target, "config.json", local_files_only=_local_only(target)))
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"--model {target!r}: its config.json cannot be read ({type(error).__name__}: "
                        f"{_first_line(error)}).") from error
    if not isinstance(config, dict):
        raise UserError(f"--model {target!r}: its config.json is not a JSON object.")
    return config


def model_config(target: str) -> Any:
    """The ``transformers`` config of a folder or hub id (``config.json`` only: no weights are read)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target, local_files_only=_local_only(target))
    except (OSError, ValueError, KeyError) as error:
        raise UserError(f"--model {target!r}: its config.json cannot be read ({type(error).__name__}: "
                        f"{_first_line(error)}).") from error


def check_model_type(config: dict[str, Any], spec: str | None = None) -> None:
    """Refuse a model family vtprune has no adapter for (names the supported ``model_type`` values)."""
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        raise UserError(f"--model {spec!r} is a {model_type!r} model; vtprune prunes the vision-language model "
                        f"types {', '.join(sorted(ADAPTERS))} (see `vtprune info`).")


def text_layers(spec: str | None) -> int | None:
    """Decoder layers of the model's language model, read from its config (None for ``tiny:`` specs).

    ``config.json`` is read directly when it states the count; a config that leaves it to the class default
    (llava-1.5's ``text_config``) is resolved by ``transformers.AutoConfig``.
    """
    target = resolve_model(spec)
    if target.startswith("tiny:"):
        return None
    raw = raw_config(target)
    layers = (raw.get("text_config") or raw).get("num_hidden_layers")
    if layers is None:
        config = model_config(target)
        layers = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", None)
    return int(layers) if layers else None


def load(spec: str | None = None, attn_implementation: str = "sdpa", dtype: str = "float32",
         device: str | None = None) -> tuple[Any, Any]:
    """``(model, processor)`` for ``spec``, in eval mode on ``device`` (CUDA when available by default).

    Everything that can be checked without the weights is checked first (:func:`check_load`), so a bad
    value fails in a second or two, not after loading. A hub id is read from the local cache when the hub
    is offline or cannot be reached.
    """
    target = check_load(spec, device, attn_implementation, dtype)
    device = check_device(device)
    if target.startswith("tiny:"):
        model, processor = tiny_model(target.split(":", 1)[1], attn_implementation)
        return model.to(device), processor
    from transformers import AutoModelForImageTextToText

    local_only = _local_only(target)
    if local_only and not Path(target).expanduser().exists():
        target = _cached_folder(target)  # from_pretrained probes adapter files online even with local_files_only
    try:
        with _quiet_progress(Path(target).resolve().is_relative_to(MODELS_DIR)):
            model = AutoModelForImageTextToText.from_pretrained(
                target, attn_implementation=attn_implementation, dtype=DTYPES[dtype], device_map=device,
                local_files_only=local_only,
            ).eval()
    except (OSError, ValueError, KeyError, ImportError) as error:
        raise UserError(f"--model {model_label(spec)!r} could not be loaded as a vision-language model "
                        f"({type(error).__name__}: {_first_line(error)}).") from error
    return model, load_processor(target, local_files_only=local_only)


def _cached_folder(repo_id: str) -> str:
    """The local snapshot folder of a cached hub id (nothing is fetched)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"--model {repo_id!r}: the hub cannot be used and the cached copy is incomplete "
                        f"({type(error).__name__}: {_first_line(error)}).") from error


@contextlib.contextmanager
def _quiet_progress(quiet: bool) -> Iterator[None]:
    """No "Loading weights" bar for the shipped models (a 9 MB file loads in milliseconds); restored after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


def load_processor(path: str, local_files_only: bool = False) -> Any:
    """``AutoProcessor.from_pretrained(path)``; Qwen-VL processors without torchvision are rebuilt from parts."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    local = {"local_files_only": local_files_only}
    try:
        processor = AutoProcessor.from_pretrained(path, **local)
    except (AttributeError, ImportError, OSError, ValueError, TypeError):
        adapter = ADAPTERS.get(AutoConfig.from_pretrained(path, **local).model_type)
        if adapter is None or adapter.processor_class is None:
            raise
        processor = _rebuilt_processor(adapter.processor_class, AutoImageProcessor.from_pretrained(path, **local),
                                       AutoTokenizer.from_pretrained(path, **local))
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    return processor


def _rebuilt_processor(class_name: str, image_processor: Any, tokenizer: Any) -> Any:
    """The model's processor class built without a video processor (Qwen-VL's needs torchvision)."""
    import transformers

    cls = no_video_processor(getattr(transformers, class_name))
    template = getattr(tokenizer, "chat_template", None)
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template)


def model_label(spec: str | None) -> str:
    """A short human name for reports (``embedded:llava``, a folder name, or the hub id)."""
    if spec in (None, "", "embedded"):
        return "embedded:llava"
    if spec.startswith(("embedded:", "tiny:")):
        return spec
    return Path(spec).name if Path(spec).exists() else spec
