"""What hooks cannot do: release a forward's state on *any* exit, and check a ``generate()`` call's options.

PyTorch runs always-called forward hooks only when the forward raises an ``Exception``; a ``KeyboardInterrupt``
(any ``BaseException``) skips them. :class:`ForwardGuard` wraps the wrapped model's ``forward`` (an attribute
of that one instance, removed exactly by ``handle.remove()``) so that the frame and the model lock that the
pre-hook took are released on every exit. :class:`GenerateGuard` wraps the instance's ``generate`` the same way:
it refuses, at the call and in one line, the decoding paths whose results a pruned cache would silently change
(``use_cache=False``, static caches, assisted / prompt-lookup decoding, chunked prefill), and it records how
long the conversation given to a ``generate()`` that continues a pruned cache is (a follow-up turn), so that
the engine feeds the language model only the tokens the cache has not seen even when ``generate()`` dropped an
all-ones attention mask; the seen tokens' ``mm_token_type_ids`` are marked text there, so that Qwen-VL's
``generate()`` does not take a seen image beyond the pruned cache's length for a new one (:func:`seen_tokens_as_text`).
A continued call gets its own per-conversation model state back (Qwen-VL's ``rope_deltas``, :func:`adopt`). A cache a
prefill pruned is marked (:class:`PrunedCache`): only the wrapping that pruned it may extend it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from vtprune.calls import CallRegistry
from vtprune.errors import UserError

PIXEL_KEYS = ("pixel_values", "pixel_values_videos")
ASSISTED = {
    "assistant_model": "assisted decoding (assistant_model=...)",
    "prompt_lookup_num_tokens": "prompt-lookup decoding (prompt_lookup_num_tokens={value!r})",
    "assistant_early_exit": "self-speculative decoding (assistant_early_exit={value!r})",
    "use_mtp": "multi-token-prediction decoding (use_mtp=True)",
}
COPY_MESSAGE = "a model wrapped by vtprune cannot be copied or pickled; call handle.remove() first."
PRUNED_CACHE_MESSAGE = (
    "vtprune: this KV cache was pruned by a vtprune wrapping that no longer holds its conversation (after "
    "handle.remove(), another wrap(), a copy of the cache, or another model): its layers lack the pruned tokens, so "
    "continuing it would give wrong answers; start the conversation again (the whole prompt with its images, a new "
    "cache).")


def cache_problem(cache: Any) -> str | None:
    """None for a cache vtprune can prune (a plain ``DynamicCache``, not offloaded, of the layers transformers
    builds by default), else the cache's kind for an error message. Pruning gives every layer its own length,
    which only that holds."""
    if cache is None:
        return None
    # Lazy: ``import vtprune`` does not load transformers (3.4 s cold here); a cache exists only once it is loaded.
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    if type(cache) is not DynamicCache:
        return f"a {type(cache).__name__}"
    if getattr(cache, "offloading", False):
        return "an offloaded DynamicCache"
    kinds = {type(layer) for layer in getattr(cache, "layers", [])} - {DynamicLayer, DynamicSlidingWindowLayer}
    if kinds:
        return f"a DynamicCache with {', '.join(sorted(k.__name__ for k in kinds))} layers"
    return None


def unsupported_cache_message(kind: str) -> str:
    return (f"vtprune cannot prune into {kind}: pruning gives every decoder layer its own cache length, which only "
            "the default DynamicCache holds; use it (generate(..., cache_implementation=None), or pass "
            "DynamicCache()), or call handle.remove() for this call.")


def _option(model: Any, kwargs: dict, name: str) -> Any:
    """The value ``generate()`` will use for ``name``: its keyword, else its generation config's, else the model's."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, name, None)


def generate_problem(model: Any, calls: CallRegistry, kwargs: dict) -> str | None:
    """A one-line error for a ``generate()`` call of ``model`` that would prune with a decoding path vtprune
    cannot keep exact, or None. Only calls that prune (images, or a cache continuing a call of ``calls``) are
    checked."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and held_elsewhere(cache, calls):
        return PRUNED_CACHE_MESSAGE
    prunes = any(kwargs.get(k) is not None for k in PIXEL_KEYS) or (
        cache is not None and calls.lookup(cache) is not None)
    if not prunes:
        return None
    if _option(model, kwargs, "use_cache") is False:
        return ("vtprune: generate(use_cache=False) is not supported on a pruned model: without a cache every "
                "step runs the prefill again, so the method would choose its tokens again at every step "
                "(prefixkv would prune nothing); keep the cache (use_cache=True, the default), or call "
                "handle.remove() for this call.")
    implementation = _option(model, kwargs, "cache_implementation")
    if implementation not in (None, "dynamic"):
        return (f"vtprune: generate(cache_implementation={implementation!r}) is not supported: pruning gives every "
                "decoder layer its own cache length, which only the default DynamicCache holds; use "
                "cache_implementation=None (or 'dynamic'), or call handle.remove() for this call.")
    kind = cache_problem(cache)
    if kind is not None:
        return unsupported_cache_message(kind)
    for name, label in ASSISTED.items():
        value = _option(model, kwargs, name)
        if value not in (None, False):
            return (f"vtprune: {label.format(value=value)} is not supported on a pruned model: it crops the cache "
                    "by positions that pruned layers do not have; decode without it (drop "
                    f"{name}), or call handle.remove() for this call.")
    if _option(model, kwargs, "prefill_chunk_size") is not None:
        return ("vtprune: chunked prefill (prefill_chunk_size=...) is not supported on a pruned model: the "
                "method must see the whole prompt at once; drop prefill_chunk_size, or call handle.remove() for "
                "this call.")
    return None


class _Guard:
    """A callable wrapping one bound method of one model instance; copying or pickling it is refused. ``calls``:
    the wrapping's per-call state (None once removed: the guard then passes every call through)."""

    def __init__(self, model: Any, calls: CallRegistry, wrapped: Any, adapter: Any = None) -> None:
        functools.update_wrapper(self, wrapped)  # name, docstring and ``__wrapped__`` (inspect.signature)
        self.model, self.adapter = model, adapter
        self.calls: CallRegistry | None = calls
        self.wrapped = wrapped
        self.name: str = ""
        self.previous: Any = None

    def __deepcopy__(self, memo: dict) -> _Guard:
        raise TypeError(COPY_MESSAGE)

    def __reduce__(self) -> Any:
        raise TypeError(COPY_MESSAGE)


class ForwardGuard(_Guard):
    """The model's ``forward``: on a ``BaseException`` that is not an ``Exception`` (which always-called hooks
    miss), close the frame the pre-hook opened for this forward (and any inner one) and release the lock."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        calls = self.calls
        frame = calls.claim() if calls is not None else None
        try:
            return self.wrapped(*args, **kwargs)
        except BaseException as error:
            if frame is not None and not isinstance(error, Exception):
                calls.unwind(frame)
            raise


class GenerateGuard(_Guard):
    """The model's ``generate``: refuse unsupported decoding paths at the call; record a follow-up's length."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        calls = self.calls
        if calls is None:
            return self.wrapped(*args, **kwargs)
        problem = generate_problem(self.model, calls, kwargs)
        if problem is not None:
            raise UserError(problem)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        call = calls.lookup(cache) if cache is not None else None
        adapter = self.adapter
        # The model's per-instance conversation state (Qwen-VL's rope_deltas) is read and written by generate()
        # before its first forward: hold the model's lock until then, and give a continued call its own state.
        with calls.held(adapter is not None and adapter.conversation_attributes != ()):
            restore = adopt(adapter, call, calls)
            try:
                return self._generate(calls, cache, call, args, kwargs)
            finally:
                restore()

    def _generate(self, calls: CallRegistry, cache: Any, call: Any, args: tuple, kwargs: dict) -> Any:
        tokens = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None or call is None:
            return self.wrapped(*args, **kwargs)
        kwargs = seen_tokens_as_text(cache, call.prompt_length + call.decoded, kwargs)
        with calls.continuing(cache, tokens.shape[1]):
            return self.wrapped(*args, **kwargs)


def adopt(adapter: Any, call: Any, calls: CallRegistry) -> Callable[[], None]:
    """Give the model ``call``'s own conversation state (Qwen-VL: the ``rope_deltas`` of its prefill, not of the
    model's last prefill, which may be another conversation's); returns what puts the previous state back, unless
    something has replaced the call's state since. A no-op for models without such state or without a call."""
    state = getattr(call, "model_state", None)
    if adapter is None or state is None:
        return _nothing
    previous = adapter.conversation_state()
    adapter.set_conversation_state(state)

    def restore() -> None:
        with calls.lock:
            now = adapter.conversation_state()
            if all(now[name] is value for name, value in state.items()):
                adapter.set_conversation_state(previous)

    return restore


def _nothing() -> None:
    return None


def seen_tokens_as_text(cache: Any, seen: int, kwargs: dict) -> dict:
    """``kwargs`` with ``mm_token_type_ids`` zeroed over the ``seen`` tokens when ``cache`` holds fewer entries.

    Qwen-VL's ``generate()`` continuing a cache looks for new images in the token types beyond the cache's
    length. After a pre-LLM stage (or KV retention) layer 0 holds fewer entries than the tokens it has seen, so
    that range can start inside the (already seen) image: ``generate()`` then takes it for a new image and, with
    no ``image_grid_thw``, numbers the turn as plain text and resets ``rope_deltas`` to 0, shifting every new
    token's M-RoPE position by the image's delta (-12 on a 4x4 grid; a follow-up turn after pruning 12 of 16
    tokens went wrong while pruning 8 did not). The seen tokens are in the cache, none of them is new: marked
    as text, ``generate()`` continues from the prompt's ``rope_deltas`` (the original positions).
    """
    types = kwargs.get("mm_token_type_ids")
    if getattr(types, "dim", lambda: 0)() != 2 or cache.get_seq_length() >= seen:
        return kwargs
    types = types.clone()
    types[:, :seen] = 0
    return {**kwargs, "mm_token_type_ids": types}


class PrunedCache:
    """The ``update`` of one pruned KV cache (an attribute of that cache instance; its class is untouched): the
    cache grows only inside a forward of the wrapping that pruned it, on the call bound to it. Any other model or
    wrapping (``handle.remove()``, a new ``wrap()``, a never-wrapped model) is refused at its first layer, before
    the cache changes, with :data:`PRUNED_CACHE_MESSAGE`; an emptied cache (``reset()``) is unmarked and grows.
    The mark holds weak references only: it keeps neither the cache nor the wrapping alive."""

    def __init__(self, cache: Any, calls: CallRegistry | None) -> None:
        import torch

        self.cache = weakref.ref(cache)
        self.calls = None if calls is None else weakref.ref(calls)
        self.run = torch.compiler.disable(self.extend)  # torch.compile runs it as written (a graph break)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    def extend(self, *args: Any, **kwargs: Any) -> Any:
        """The cache's own ``update``, when the forward running on this thread continues the cache's call."""
        cache, calls = self.cache(), None if self.calls is None else self.calls()
        if calls is None or not calls.serving(cache):
            if cache.get_seq_length() > 0:
                raise UserError(PRUNED_CACHE_MESSAGE)
            unmark(cache)
        return type(cache).update(cache, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> PrunedCache:
        """A deep copy of a pruned cache is pruned too, and bound to no call: it refuses to grow."""
        copy = memo.get(id(self.cache()))
        return self if copy is None else PrunedCache(copy, None)

    def __reduce__(self) -> tuple:
        """Pickling (``torch.save`` of a pruned cache): the loaded cache is pruned too and, like a deep copy, bound
        to no call, so it refuses to grow (its weak references and compiled wrapper are not pickled)."""
        return PrunedCache, (self.cache(), None)


def mark_pruned(cache: Any, calls: CallRegistry) -> None:
    """Mark ``cache`` as pruned by the wrapping whose per-call state is ``calls`` (see :class:`PrunedCache`)."""
    cache.__dict__["update"] = PrunedCache(cache, calls)


def unmark(cache: Any) -> None:
    if isinstance(cache.__dict__.get("update"), PrunedCache):
        del cache.__dict__["update"]


def held_elsewhere(cache: Any, calls: CallRegistry) -> bool:
    """Whether ``cache`` holds pruned entries of a call that the wrapping of ``calls`` does not hold."""
    mark = getattr(cache, "__dict__", {}).get("update")
    return isinstance(mark, PrunedCache) and calls.lookup(cache) is None and cache.get_seq_length() > 0


def install(model: Any, calls: CallRegistry, adapter: Any = None) -> list[weakref.ref]:
    """Put the two guards on ``model`` (instance attributes), serving the wrapping whose per-call state is
    ``calls`` (``adapter``: the model's, for its per-conversation state). Returns weak references for
    :func:`uninstall`: the model holds its guards, the handle does not (nothing of transformers' is reachable
    from the handle)."""
    installed = []
    for name, kind in (("forward", ForwardGuard), ("generate", GenerateGuard)):
        if not callable(getattr(model, name, None)):
            continue
        guard = kind(model, calls, getattr(model, name), adapter)
        guard.name, guard.previous = name, model.__dict__.get(name)  # an instance attribute (accelerate's forward)
        object.__setattr__(model, name, guard)
        installed.append(weakref.ref(guard))
    return installed


def uninstall(model: Any, installed: list[weakref.ref]) -> None:
    """Restore the model's own attributes; a guard that something else wrapped since becomes a pass-through."""
    for ref in reversed(installed):
        guard = ref()
        if guard is None:
            continue
        guard.calls, guard.adapter = None, None
        if model.__dict__.get(guard.name) is guard:
            if guard.previous is None:
                del model.__dict__[guard.name]
            else:
                model.__dict__[guard.name] = guard.previous
