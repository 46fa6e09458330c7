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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Frame:
    """One forward of the wrapped model on one thread: its call (None: this forward is not pruned)."""

    call: Any = None
    locked: bool = False
    guarded: bool = False  # claimed by the forward guard, which closes it on a BaseException


@dataclass
class _Local(threading.local):
    frames: list[Frame] = field(default_factory=list)
    pending: dict[str, Any] = field(default_factory=dict)
    last_stats: Any = None
    request: dict[str, Any] = field(default_factory=dict)
    continuing: dict[int, int] = field(default_factory=dict)


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
        frame = Frame(locked=True)
        self._local.frames.append(frame)
        return frame

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
