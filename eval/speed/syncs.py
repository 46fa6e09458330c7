"""Count host-device synchronisation points, optionally only inside vtprune's hooks (``vtprune.eval.speed.syncs``).

A GPU runs ahead of Python until Python needs a value from it; every such point stalls the host until the
device queue drains. This module counts them on any device, CPU included, so a CPU test can prove that a
code path would not stall a GPU.

What is counted (``counter.by_op`` keys in brackets):

* scalar reads: ``.item()`` [``item``], ``bool(t)`` / ``if t:`` [``bool``], ``int(t)`` [``int``],
  ``float(t)`` [``float``], ``t.__index__`` (``range(t)``, list indexing) [``index``];
* copies to the host: ``.tolist()`` [``tolist``], ``.numpy()`` [``numpy``], ``.cpu()`` [``cpu``], and
  ``.to(...)`` when it copies a tensor from a device to the CPU or names the CPU as the literal string
  ``"cpu"`` [``to(cpu)``] (on a CPU-only run ``x.to(other.device)`` is not counted: on a GPU it stays put);
* host data copied to a device: ``torch.tensor(data, device=d)`` / ``torch.as_tensor(data, device=d)`` with
  a device given as a ``torch.device`` or a non-CPU string [``tensor(host->device)``]; from pageable host
  memory CUDA waits for the stream;
* data-dependent shapes: ``nonzero`` / ``argwhere`` / ``torch.where(cond)``, boolean-mask indexing
  ``x[mask]`` [``getitem(bool mask)``] and ``x[mask] = v`` [``setitem(bool mask)``; ``masked_fill_`` is free], ``masked_select``,
  ``unique`` / ``unique_consecutive``, ``repeat_interleave`` with tensor repeats and no ``output_size``,
  ``bincount``, and Python-valued comparisons ``equal`` / ``allclose``;
* ``torch.cuda.synchronize()`` [``cuda.synchronize``].

How: a ``TorchFunctionMode`` sees every torch function and Tensor method called from Python (host copies
and scalar reads are named there); a ``TorchDispatchMode`` sees the aten ops underneath, including those
inside composite ops (``aten._local_scalar_dense``, ``aten.nonzero``, ``aten._unique2``, ``aten.index``
with a boolean index, ...). One Python-level call counts at most once; an aten op found under an unnamed
call is counted as ``"<function>/<aten op>"``. Plain arithmetic, views, indexing with integer tensors,
``torch.arange``/``torch.full`` and reductions that stay on the device count zero.

API::

    from vtprune.eval.speed.syncs import count_syncs, watch_hooks

    with count_syncs() as syncs:                       # everything inside the block
        model(**inputs)
    syncs.total, syncs.by_op                           # 3, {"item": 1, "nonzero": 2}

    with count_syncs(only=lambda: flag[0]) as syncs:   # only while a predicate is true
        ...

    # Only inside vtprune's hooks, split by phase (a decode step should show zero).
    with vtprune.apply(model, "fastv", keep=0.25) as handle, watch_hooks(handle) as hooks, \\
            count_syncs(only=hooks.inside, group=hooks.phase) as syncs:
        model.generate(**inputs, max_new_tokens=8)
    syncs.by_group["decode"]                           # Counter of ops inside hooks during decode steps
    hooks.forwards["decode"], hooks.seconds["decode"]  # decode forwards seen, seconds spent inside hooks

``watch_hooks`` wraps the hook functions of a :class:`vtprune.PruneHandle` in place (same hook ids, so
``handle.remove()`` still removes them) and restores them on exit; it also times them, which is how the
speed benchmark reports the host time spent inside hooks per decode step. ``count_syncs`` adds Python work
to every torch call: use it in counting runs, never in timed ones.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SCALAR_METHODS = {"item": "item", "__bool__": "bool", "__int__": "int", "__float__": "float",
                  "__index__": "index", "tolist": "tolist", "numpy": "numpy", "cpu": "cpu"}
SHAPE_FUNCTIONS = {"nonzero": "nonzero", "argwhere": "nonzero", "masked_select": "masked_select",
                   "unique": "unique", "unique_consecutive": "unique", "bincount": "bincount",
                   "equal": "equal", "allclose": "allclose"}
ATEN_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "unique_dim_consecutive", "bincount", "equal", "allclose", "is_nonzero"}


@dataclass
class SyncCounter:
    """Counts of synchronisation points: ``total``, ``by_op`` (op name -> count), ``by_group`` (group -> Counter)."""

    total: int = 0
    by_op: Counter = field(default_factory=Counter)
    by_group: dict[str, Counter] = field(default_factory=dict)

    def add(self, op: str, group: str | None) -> None:
        self.total += 1
        self.by_op[op] += 1
        if group is not None:
            self.by_group.setdefault(group, Counter())[op] += 1

    def in_group(self, group: str) -> int:
        """Syncs counted in ``group`` (0 when none)."""
        return sum(self.by_group.get(group, Counter()).values())


class _State:
    """Shared between the two modes: the counter, the filters and the Python-level call being run."""

    def __init__(self, counter: SyncCounter, only: Callable[[], bool] | None,
                 group: Callable[[], str | None] | None) -> None:
        self.counter, self.only, self.group = counter, only, group
        self.current: str | None = None  # name of the Python-level torch call in progress
        self.counted = False             # that call was already counted

    def count(self, op: str) -> None:
        if self.only is not None and not self.only():
            return
        self.counter.add(op, self.group() if self.group is not None else None)


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


def _is_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value)
        except (RuntimeError, TypeError):
            return None
    return None


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` is a device-to-host copy (or names ``"cpu"`` literally)."""
    source = args[0]
    targets = [*args[1:2], kwargs.get("device"), kwargs.get("other")]
    for target in targets:
        device = _device_of(target)
        if device is None or device.type != "cpu":
            continue
        return source.device.type != "cpu" or (isinstance(target, str) and target.startswith("cpu"))
    return False


def _host_to_device(args: tuple, kwargs: dict) -> bool:
    device = kwargs.get("device")
    if device is None or isinstance(args[0] if args else None, torch.Tensor):
        return False
    return isinstance(device, torch.device) or (isinstance(device, str) and not device.startswith("cpu"))


def classify_call(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The sync name of a Python-level torch call, or None when it does not synchronise by itself."""
    name = _name(func)
    if name in SCALAR_METHODS:
        return SCALAR_METHODS[name]
    if name == "to" and args and isinstance(args[0], torch.Tensor):
        return "to(cpu)" if _to_cpu(args, kwargs) else None
    if name in ("tensor", "as_tensor"):
        return "tensor(host->device)" if _host_to_device(args, kwargs) else None
    if name == "__getitem__" and len(args) > 1 and _is_bool_index(args[1]):
        return "getitem(bool mask)"
    if name == "__setitem__" and len(args) > 2 and _is_bool_index(args[1]):
        return "setitem(bool mask)"  # an index_put_ with a boolean index; use masked_fill_ for a scalar
    if name == "where" and len(args) + len(kwargs) == 1:
        return "nonzero"
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None and len(args) < 4:
            return "repeat_interleave"
        return None
    return SHAPE_FUNCTIONS.get(name)


def classify_aten(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The sync name of an aten op seen by the dispatch mode, or None."""
    packet = getattr(func, "overloadpacket", None)
    name = _name(packet) if packet is not None else _name(func)
    if name in ATEN_SYNCS:
        return name
    if name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor) \
            and kwargs.get("output_size") is None:
        return name
    if name in ("index", "index_put", "index_put_") and len(args) > 1 and isinstance(args[1], (list, tuple)):
        return f"{name}(bool mask)" if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in args[1]) else None
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        if isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None \
                and torch.device(target).type == "cpu":
            return "to(cpu)"
    return None


class _FunctionMode(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        if state.current is not None:  # nested call (the mode is normally off inside its own handler)
            return func(*args, **kwargs)
        op = classify_call(func, args, kwargs)
        state.current, state.counted = _name(func), op is not None
        try:
            if op is not None:
                state.count(op)
            return func(*args, **kwargs)
        finally:
            state.current, state.counted = None, False


class _DispatchMode(TorchDispatchMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        if not state.counted:
            op = classify_aten(func, args, kwargs)
            if op is not None:
                state.counted = state.current is not None  # once per Python-level call
                state.count(op if state.current is None else f"{state.current}/{op}")
        return func(*args, **kwargs)


@contextmanager
def count_syncs(only: Callable[[], bool] | None = None,
                group: Callable[[], str | None] | None = None) -> Iterator[SyncCounter]:
    """Count host-device synchronisation points inside the block (see the module docstring).

    ``only``: a predicate evaluated at each sync; the sync counts only when it returns True (for example
    ``watch_hooks(handle).inside``). ``group``: a callable naming the group a sync is filed under in
    ``counter.by_group`` (for example ``watch_hooks(handle).phase``: ``"prefill"`` or ``"decode"``).
    """
    counter = SyncCounter()
    state = _State(counter, only, group)
    original = torch.cuda.synchronize

    def synchronize(*args: Any, **kwargs: Any) -> None:
        state.count("cuda.synchronize")
        original(*args, **kwargs)

    torch.cuda.synchronize = synchronize
    try:
        with _FunctionMode(state), _DispatchMode(state):
            yield counter
    finally:
        torch.cuda.synchronize = original


class HookWatch:
    """The wrapped hooks of one handle: whether a hook is running, the phase, and time spent in hooks.

    ``inside()``: True while one of the handle's hooks runs (in this thread). ``phase()``: ``"prefill"`` or
    ``"decode"`` for the model forward in progress (decode = the cache already holds tokens), None outside
    a forward. ``forwards[phase]``: model forwards seen; ``seconds[phase]`` / ``calls[phase]``: host time in
    the handle's hooks and hook calls (on CUDA the time kernels take to launch, not to run).
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._phase: str | None = None
        self.forwards: Counter = Counter()
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    def inside(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def phase(self) -> str | None:
        return self._phase

    def per_forward_us(self, phase: str) -> float:
        """Microseconds inside the hooks per model forward of ``phase`` (nan when there was none)."""
        return 1e6 * self.seconds[phase] / self.forwards[phase] if self.forwards[phase] else float("nan")

    def reset(self) -> None:
        self.forwards.clear()
        self.seconds.clear()
        self.calls.clear()

    def _wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            local = self._local
            local.depth = getattr(local, "depth", 0) + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth -= 1
                if local.depth == 0 and self._phase is not None:
                    self.seconds[self._phase] += time.perf_counter() - start
                    self.calls[self._phase] += 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def _phase_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        filled = cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0
        self._phase = "decode" if filled else "prefill"
        self.forwards[self._phase] += 1

    def _end_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._phase = None


@contextmanager
def watch_hooks(handle: Any) -> Iterator[HookWatch]:
    """Wrap every hook of ``handle`` (a :class:`vtprune.PruneHandle`) with a :class:`HookWatch`; undone on exit.

    Given a bare model (``nn.Module``) instead, only the phase is tracked (``inside()`` stays False): the
    unwrapped reference of a comparison. Hooks registered later (another ``wrap``) are not watched. The
    phase is read by two extra hooks on the model, registered first (pre-hook) and last (forward hook) so
    that they enclose vtprune's own.
    """
    watch = HookWatch()
    replaced: list[tuple[dict, int, Callable]] = []
    model = handle if isinstance(handle, torch.nn.Module) else handle.model
    hooks = [] if isinstance(handle, torch.nn.Module) else list(getattr(handle, "_hooks", []))
    for hook in hooks:  # the handle's RemovableHandles (engine internals)
        table = hook.hooks_dict_ref()
        if table is not None and hook.id in table:
            replaced.append((table, hook.id, table[hook.id]))
            table[hook.id] = watch._wrap(table[hook.id])
    extra = [model.register_forward_pre_hook(watch._phase_hook, with_kwargs=True, prepend=True),
             model.register_forward_hook(watch._end_hook, with_kwargs=True, always_call=True)]
    try:
        yield watch
    finally:
        for hook in extra:
            hook.remove()
        for table, key, fn in replaced:
            if key in table:
                table[key] = fn
