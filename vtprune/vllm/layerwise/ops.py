"""PrefixKV's two steps inside vLLM's language model as registered ops, so a compiled model still runs them.

vLLM compiles the language model with ``torch.compile``, which traces module hooks into the graph: Python control
flow inside a hook would be frozen as it ran while tracing. PrefixKV's hooks therefore only call an op each,
``vtprune::retention_attend`` (an attention layer's queries, keys and values) and ``vtprune::retention_end`` (after
the final norm), opaque to the compiler: the op finds its runtime through the attention layer's name (vLLM's own key: the forward context maps it to this
engine's ``Attention`` module, which holds the runtime), so a graph loaded from vLLM's compile cache in another
process calls this process's runtime. Each op declares that it mutates its first tensor (it does not: an op with
neither outputs nor mutations would be dropped from the graph). Uniform decode steps find nothing to do, so a CUDA
graph that captured them replays correctly without them. vLLM's compile-cache key ignores ``hf_overrides``, so the
config hook adds PrefixKV to ``additional_config`` (hashed): a graph traced without these ops is never loaded for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

#: the attribute of an attention module that holds its runtime (a weak reference)
ATTRIBUTE = "_vtprune_retention"


def register(runtime: Any, attention: Any) -> str:
    """Make ``attention`` (vLLM's ``Attention``) find ``runtime``; its ``layer_name``, which the hooks pass."""
    setattr(attention, ATTRIBUTE, weakref.ref(runtime))
    return attention.layer_name


def unregister(attention: Any) -> None:
    attention.__dict__.pop(ATTRIBUTE, None)


#: vtprune's ops, registered straight into a library fragment (see :func:`define_op`)
_LIBRARY = torch.library.Library("vtprune", "FRAGMENT")


def define_op(fake: Callable[..., Any], mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Any]:
    """Register the decorated function as ``torch.ops.vtprune.<its name>`` for every device, its schema inferred
    from its annotations, ``fake`` its meta function for tracing; returns the op. A call is one dispatcher call:
    ``torch.library.custom_op`` binds every call's arguments in Python first (24 us a call against 2.7 us, on this project's CPU), which
    the ops' 32 to 64 calls per step (one or two per decoder layer) would pay in every decode step."""

    def register(function: Callable[..., Any]) -> Any:
        name = function.__name__
        _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates_args))
        _LIBRARY.impl(name, function, "CompositeExplicitAutograd")
        torch.library.register_fake(f"vtprune::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.vtprune, name)

    return register


def _runtime(layer_name: str) -> Any:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    module = get_forward_context().no_compile_layers.get(layer_name)
    ref = getattr(module, ATTRIBUTE, None)
    return ref() if ref is not None else None


def _attend_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str, layer: int) -> None:
    return None


@define_op(_attend_fake, mutates_args=("query",))
def retention_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str, layer: int) -> None:
    """Layer ``layer``'s priorities and entries of the prompts prefilling now (``RetentionRuntime.attend``)."""
    target = _runtime(layer_name)
    if target is not None:
        target.attend(layer, query, key, value)


def _end_fake(hidden: torch.Tensor, layer_name: str) -> None:
    return None


@define_op(_end_fake, mutates_args=("hidden",))
def retention_end(hidden: torch.Tensor, layer_name: str) -> None:
    """The end of a forward: each prompt whose prefill ended keeps its entries (``RetentionRuntime.end``); found
    through layer 0's ``layer_name``."""
    target = _runtime(layer_name)
    if target is not None:
        target.end()
