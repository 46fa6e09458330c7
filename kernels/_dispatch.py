"""Implementation selection for the vtprune kernels.

``impl`` is one of ``"auto"``, ``"triton"`` or ``"torch"``. ``"auto"`` picks Triton for CUDA tensors when
``triton`` imports and the pure-PyTorch reference otherwise. The environment variable ``VTPRUNE_KERNEL_IMPL``
(same three values) replaces ``"auto"``; an explicit ``impl="triton"`` / ``impl="torch"`` at the call site wins.

Triton is imported lazily, only when a Triton path is actually taken, so ``import vtprune.kernels`` needs neither
triton nor a GPU. On CPU tensors Triton only runs through its interpreter (``TRITON_INTERPRET=1``), which must be
set before the ``@triton.jit`` functions are defined; :func:`load_triton_module` re-imports a kernel module that
was first imported without it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType

import torch

ENV_VAR = "VTPRUNE_KERNEL_IMPL"
IMPLS = ("auto", "triton", "torch")

_TRITON_IMPORT_ERROR: BaseException | None = None
_TRITON_CHECKED = False


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set (Triton then runs on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_import_error() -> BaseException | None:
    """Import triton once; return the exception it raised, or None if it imports."""
    global _TRITON_CHECKED, _TRITON_IMPORT_ERROR
    if not _TRITON_CHECKED:
        _TRITON_CHECKED = True
        try:
            importlib.import_module("triton")
        except Exception as exc:  # noqa: BLE001 - any failure means "no triton"
            _TRITON_IMPORT_ERROR = exc
    return _TRITON_IMPORT_ERROR


def triton_available() -> bool:
    """True when ``import triton`` succeeds."""
    return triton_import_error() is None


def _requested(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}; pass 'auto', 'triton' or 'torch'.")
    if impl == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            if env not in IMPLS:
                raise ValueError(f"{ENV_VAR}={env!r} is not one of {IMPLS}; unset it or use one of those.")
            return env
    return impl


def resolve_impl(impl: str, device: torch.device, triton_dtype_ok: bool = True) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors on ``device``.

    Args:
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (``"auto"`` may be replaced by ``$VTPRUNE_KERNEL_IMPL``).
        device: device of the inputs.
        triton_dtype_ok: False when the Triton kernel does not support the input dtype; ``"auto"`` then
            uses torch and an explicit ``"triton"`` raises.

    Raises:
        RuntimeError: ``"triton"`` was requested but triton does not import, or the tensors are on CPU and
            ``TRITON_INTERPRET=1`` is not set.
        ValueError: unknown ``impl``, or ``"triton"`` with an unsupported dtype.
    """
    req = _requested(impl)
    if req == "torch":
        return "torch"
    if req == "auto":
        if device.type == "cuda" and triton_dtype_ok and triton_available():
            return "torch" if interpreter_enabled() else "triton"
        return "torch"
    err = triton_import_error()
    if err is not None:
        raise RuntimeError(
            f"impl='triton' was requested but `import triton` failed ({type(err).__name__}: {err}). "
            "Install it with `pip install triton`, or use impl='torch'."
        ) from err
    if not triton_dtype_ok:
        raise ValueError(
            "impl='triton' does not support this input dtype; cast to float32/float16/bfloat16 or use "
            "impl='torch'."
        )
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(
            "impl='triton' got CPU tensors, but Triton runs on CPU only through its interpreter: set "
            "TRITON_INTERPRET=1 in the environment before importing vtprune.kernels (it must be set before the "
            "Triton kernels are defined), move the tensors to CUDA, or use impl='torch'."
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(
            f"impl='triton' does not support device {device}; use CUDA tensors or impl='torch'."
        )
    return "triton"


def check_environment(device: torch.device) -> None:
    """Check ``$VTPRUNE_KERNEL_IMPL`` once, where a model is wrapped on ``device`` (one-line ``ValueError``).

    The kernels read the variable at every call; a value they would refuse there (unknown, ``triton`` without
    an importable triton, ``triton`` for a CPU model without ``TRITON_INTERPRET=1``) is refused here first, so
    the error is not a traceback from inside ``generate``. Devices other than CPU / CUDA (``meta`` under
    offload) are not judged.
    """
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if not env:
        return
    if env not in IMPLS:
        raise ValueError(f"{ENV_VAR}={env!r} is not one of {', '.join(IMPLS)}; unset it or use one of those.")
    if env != "triton":
        return
    err = triton_import_error()
    if err is not None:
        reason = (str(err).strip().splitlines() or [""])[0][:120]
        raise ValueError(f"{ENV_VAR}=triton but `import triton` failed ({type(err).__name__}: {reason}); install "
                         f"it (pip install triton) or unset {ENV_VAR} (or set it to 'torch').")
    if device.type == "cpu" and not interpreter_enabled():
        raise ValueError(f"{ENV_VAR}=triton but the model is on the CPU, where Triton runs only through its "
                         f"interpreter: also set TRITON_INTERPRET=1, move the model to CUDA, or unset {ENV_VAR}.")


def load_triton_module(name: str) -> ModuleType:
    """Import ``vtprune.kernels.<name>`` (a module defining ``@triton.jit`` kernels) lazily.

    The module records whether the interpreter was on when its kernels were defined (``INTERPRETED``); if that
    differs from the current environment it is re-imported so the kernels match the current mode.
    """
    module = importlib.import_module(f"{__package__}.{name}")
    if getattr(module, "INTERPRETED", None) != interpreter_enabled():
        module = importlib.reload(module)
    return module


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for a Triton launch (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
