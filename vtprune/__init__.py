"""vtprune: layer-wise visual-token pruning for Hugging Face vision-language models.

``import vtprune`` changes nothing global; every hook belongs to one wrapped model instance.

>>> model, processor = vtprune.load("embedded:llava", device="cpu")  # doctest: +SKIP
>>> handle = vtprune.wrap(model, method="fastv", keep=0.25)   # doctest: +SKIP
>>> model.generate(**inputs)                                   # doctest: +SKIP
>>> handle.remove()                                            # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vtprune.api import apply, wrap
    from vtprune.config import PruneConfig, Stage, keep_count
    from vtprune.engine import PruneHandle
    from vtprune.methods import Capture, Scorer, list_methods, register_method, resolve
    from vtprune.scoring import ScoreContext
    from vtprune.state import CallStats, StageRecord

__version__ = "0.1.0"

# The public names, imported on first use (PEP 562): `import vtprune` imports no torch, so the command line
# answers --help without it. `vtprune.wrap`, `from vtprune import wrap` and `vtprune.engine` work as before.
_PUBLIC = {"apply": "api", "wrap": "api", "PruneConfig": "config", "Stage": "config", "keep_count": "config",
           "PruneHandle": "engine", "Capture": "methods", "Scorer": "methods", "list_methods": "methods",
           "register_method": "methods", "resolve": "methods", "ScoreContext": "scoring", "CallStats": "state",
           "StageRecord": "state"}


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use) or a submodule (``vtprune.engine``)."""
    if name.startswith("__"):
        raise AttributeError(f"module 'vtprune' has no attribute {name!r}")
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"vtprune.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"vtprune.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"vtprune.{name}":
            raise
        raise AttributeError(f"module 'vtprune' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def load(spec: str | None = None, *, device: str | None = None, dtype: str | torch.dtype = "float32",
         attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """Load a vision-language model and its processor: ``(model, processor)``, the model in eval mode.

    ``spec``: ``"embedded:llava"`` (the default) or ``"embedded:qwen2_vl"``, the tiny models shipped in the
    package (trained on the vtprune-shapes task: see the README); a folder saved with ``save_pretrained``; a
    hub id such as ``"llava-hf/llava-1.5-7b-hf"`` or ``"Qwen/Qwen2.5-VL-7B-Instruct"``; or
    ``"tiny:<model_type>"`` (random weights, for tests). ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or
    ``"auto"`` (accelerate spreads the model over the GPUs); default CUDA when available. ``dtype``:
    ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"auto"`` (the checkpoint's) or a ``torch.dtype``.
    ``attn_implementation``: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``.

    Bad values raise :class:`vtprune.errors.UserError` (a ``ValueError``) before any weight is read: an
    unknown model type, a missing folder, a hub id that is neither cached nor reachable, CUDA or flash-attn
    that this machine lacks. Loading is an application helper, not part of the pruning library: any model
    and processor from ``transformers`` can be passed to :func:`wrap` as well.
    """
    # Imported here, not at the top: the library must not import the applications (vtprune.models pulls the
    # embedded-model files, the hub client and transformers' auto classes), and `import vtprune` stays cheap.
    import torch

    from vtprune.models.loading import load as load_model

    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    return load_model(spec, attn_implementation, dtype, device)

__all__ = [
    "CallStats", "Capture", "PruneConfig", "PruneHandle", "ScoreContext", "Scorer", "Stage", "StageRecord", "apply",
    "keep_count",
    "list_methods", "load", "register_method", "resolve", "wrap", "__version__",
]
