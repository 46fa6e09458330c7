"""PrefixKV's two steps inside vLLM's language model as registered ops, so a compiled model still runs them.

vLLM compiles the language model with ``torch.compile``, which traces module hooks into the graph: Python control
flow inside a hook would be frozen as it ran while tracing. PrefixKV's hooks therefore only call an op each,
``vtprune::retention_attend`` (an attention layer's queries, keys and values) and ``vtprune::retention_end`` (after
the final norm), opaque to the compiler: the op finds its runtime by key and does the work in Python when the graph
runs. Each op declares that it mutates its first tensor (it does not: an op with neither outputs nor mutations
would be dropped from the graph). Uniform decode steps find nothing to do, so a CUDA graph that captured them
replays correctly without them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

#: key -> the runtime (weakly held) whose hooks call the ops; an entry per live runtime, removed with it
_RUNTIMES: dict[str, weakref.ref] = {}


def register(runtime: Any) -> str:
    """A key for ``runtime`` (its hooks pass it to the ops)."""
    key = f"retention-{id(runtime)}"
    _RUNTIMES[key] = weakref.ref(runtime)
    return key


def unregister(key: str) -> None:
    _RUNTIMES.pop(key, None)


def _runtime(key: str) -> Any:
    ref = _RUNTIMES.get(key)
    return ref() if ref is not None else None


@torch.library.custom_op("vtprune::retention_attend", mutates_args=("query",))
def retention_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runtime: str, layer: int) -> None:
    """Layer ``layer``'s priorities and entries of the prompts prefilling now (``RetentionRuntime.attend``)."""
    target = _runtime(runtime)
    if target is not None:
        target.attend(layer, query, key, value)


@retention_attend.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runtime: str, layer: int) -> None:
    return None


@torch.library.custom_op("vtprune::retention_end", mutates_args=("hidden",))
def retention_end(hidden: torch.Tensor, runtime: str) -> None:
    """The end of a forward: each prompt whose prefill ended keeps its entries (``RetentionRuntime.end``)."""
    target = _runtime(runtime)
    if target is not None:
        target.end()


@retention_end.register_fake
def _(hidden: torch.Tensor, runtime: str) -> None:
    return None
