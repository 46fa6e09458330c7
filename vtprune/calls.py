"""Per-call state of a wrapped model, owned by the engine and keyed by the call, never by the handle.

* The forward running on a thread has a *frame* on that thread's stack (``current()``): every hook of that
  forward finds its call there, so a text-only forward on one thread cannot switch pruning off for an image
  forward on another.
* After a prefill, the small decode state of the call is bound to its KV-cache object through a weak
  reference (``bind`` / ``lookup``): interleaved requests (prefill A, prefill B, decode A) each find their own
  state, and the state is freed with the cache, so nothing of a finished ``generate()`` stays reachable.
* Forwards of one wrapped model are serialised by a re-entrant lock (held from the model's pre-hook to its
  always-called post-hook): several threads may call ``generate()`` on one model and get exactly the results
  of running the calls one after another.
* Captures made outside any forward on a thread (``generate()`` runs the vision tower before the first
  forward) wait in that thread's ``pending`` dict and are adopted by the next call that starts on the thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Frame:
    """One forward of the wrapped model on one thread: its call (None: this forward is not pruned)."""

    call: Any = None
    locked: bool = False
    guarded: bool = False  # claimed by the forward guard, which closes it on a BaseException
    restore: Callable[[], None] | None = None  # undoes what the forward set on the model (run when it closes)


@dataclass(eq=False)
class Hold:
    """The model's lock taken by a ``generate()`` call until its first forward takes it (:meth:`CallRegistry.held`)."""

    released: bool = False


@dataclass
class _Local(threading.local):
    frames: list[Frame] = field(default_factory=list)
    pending: dict[str, Any] = field(default_factory=dict)
    last_stats: Any = None
    request: dict[str, Any] = field(default_factory=dict)
    continuing: dict[int, int] = field(default_factory=dict)
    holds: list[Hold] = field(default_factory=list)


class CallRegistry:
    """Frames of the running forwards (per thread) and decode states of live caches (weakly keyed)."""

    def __init__(self) -> None:
        self._local = _Local()
        self._lock = threading.RLock()
        self._by_cache: dict[int, tuple[weakref.ref, Any]] = {}

    # -- forwards ---------------------------------------------------------------------------------
    def enter(self) -> Frame:
        """Start a forward on this thread: take the model's lock and push an empty frame."""
        self._lock.acquire()
        holds = self._local.holds
        while holds:  # a generate() held the lock until now, its first forward: the frame holds it from here
            hold = holds.pop()
            if not hold.released:
                hold.released = True
                self._lock.release()
        frame = Frame(locked=True)
        self._local.frames.append(frame)
        return frame

    @contextmanager
    def held(self, hold: bool = True) -> Iterator[None]:
        """Hold the model's lock from here until the next forward on this thread takes it (or this block ends):
        what ``generate()`` reads and writes on the model before its first forward (Qwen-VL's ``rope_deltas``) is
        then not changed by another thread in between."""
        if not hold:
            yield
            return
        self._lock.acquire()
        mine = Hold()
        self._local.holds.append(mine)
        try:
            yield
        finally:
            self._local.holds[:] = [h for h in self._local.holds if h is not mine]
            if not mine.released:
                mine.released = True
                self._lock.release()

    @property
    def lock(self) -> Any:
        """The model's re-entrant lock (held by every forward of the wrapped model)."""
        return self._lock

    def claim(self) -> Frame | None:
        """The frame the model's pre-hook just opened for this forward, marked as the forward guard's (or None)."""
        frames = self._local.frames
        if not frames or frames[-1].guarded:
            return None
        frames[-1].guarded = True
        return frames[-1]

    def unwind(self, frame: Frame) -> None:
        """Close ``frame`` and every frame above it on this thread, releasing their locks (a forward that ended
        with a ``BaseException``, whose always-called hooks did not run)."""
        frames = self._local.frames
        if any(f is frame for f in frames):
            while frames and self.exit() is not frame:
                pass

    def unwind_to(self, depth: int) -> None:
        """Close this thread's frames above the first ``depth`` ones."""
        while len(self._local.frames) > depth:
            self.exit()

    def exit(self) -> Frame | None:
        """End the forward on this thread: pop its frame and release the lock (no-op without a frame)."""
        frames = self._local.frames
        if not frames:
            return None
        frame = frames.pop()
        restore, frame.restore = frame.restore, None
        try:
            if restore is not None:
                restore()
        finally:
            if frame.locked:
                frame.locked = False
                self._lock.release()
        return frame

    @property
    def frames(self) -> list[Frame]:
        """This thread's open frames, innermost last."""
        return self._local.frames

    def current(self) -> Any:
        """The call of the forward running on this thread, or None."""
        frames = self._local.frames
        return frames[-1].call if frames else None

    # -- decode states, keyed by their cache --------------------------------------------------------
    def bind(self, cache: Any, call: Any) -> None:
        """Keep ``call`` for later forwards that pass ``cache``; dropped when ``cache`` is garbage-collected."""
        key = id(cache)
        registry = self._by_cache

        def forget(_: weakref.ref, key: int = key) -> None:
            entry = registry.get(key)
            if entry is not None and entry[0]() is None:
                registry.pop(key, None)

        with self._lock:
            registry[key] = (weakref.ref(cache, forget), call)

    def lookup(self, cache: Any) -> Any:
        """The call bound to ``cache`` (the very object), or None."""
        entry = self._by_cache.get(id(cache))
        if entry is None or entry[0]() is not cache:
            return None
        return entry[1]

    def serving(self, cache: Any) -> bool:
        """Whether the forward running on this thread continues the call bound to ``cache``."""
        call = self.lookup(cache)
        return call is not None and self.current() is call

    def unbind(self, cache: Any) -> None:
        with self._lock:
            entry = self._by_cache.get(id(cache))
            if entry is not None and entry[0]() is cache:
                self._by_cache.pop(id(cache), None)

    def live_calls(self) -> int:
        """Number of caches whose decode state is still held (they are alive somewhere)."""
        return sum(1 for ref, _ in list(self._by_cache.values()) if ref() is not None)

    @contextmanager
    def continuing(self, cache: Any, total: int) -> Iterator[None]:
        """While a ``generate()`` call continues ``cache`` on this thread: the conversation it was given is
        ``total`` tokens long (its first forward may feed tokens the cache has already seen)."""
        table, key = self._local.continuing, id(cache)
        previous = table.get(key)
        table[key] = total
        try:
            yield
        finally:
            if previous is None:
                table.pop(key, None)
            else:
                table[key] = previous

    def take_total(self, cache: Any) -> int | None:
        """The conversation length recorded for ``cache`` on this thread (once: only the first forward uses it)."""
        return self._local.continuing.pop(id(cache), None)

    # -- per-thread data ------------------------------------------------------------------------------
    @property
    def pending(self) -> dict[str, Any]:
        """Captures made on this thread outside a forward, for the next call that starts here."""
        return self._local.pending

    def take_pending(self) -> dict[str, Any]:
        pending, self._local.pending = self._local.pending, {}
        return pending

    @property
    def request(self) -> dict[str, Any]:
        """Per-thread options of the next calls (``set_evidence``, ``set_image_sizes``)."""
        return self._local.request

    @property
    def last_stats(self) -> Any:
        return self._local.last_stats

    @last_stats.setter
    def last_stats(self, stats: Any) -> None:
        self._local.last_stats = stats

    def clear(self) -> None:
        with self._lock:
            self._by_cache.clear()
        self._local.pending = {}


def cache_of(kwargs: dict) -> Any:
    """The KV cache a forward was given (``cache``, or ``past_key_values`` before transformers 5.24), or None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def cache_of_output(output: Any) -> Any:
    """The KV cache a forward returned, or None."""
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None) if not isinstance(output, dict) else output.get(name)
        if cache is not None and hasattr(cache, "get_seq_length"):
            return cache
    return None
