"""KV memory of the pruned layers: their own KV cache groups, whose manager allocates only the kept tokens.

Two kinds of group, one base (:class:`KeptSlotsManager`: full-attention bookkeeping over fewer slots than tokens):

* the layer-wise methods' regions (:class:`PrunedAttentionSpec`, :class:`PrunedManager`): the counts are known when a
  request arrives, so only the kept tokens are ever allocated;
* PrefixKV's layers (:class:`RetainedAttentionSpec`, :class:`RetainedManager`): every decoder layer is a group of its
  own, its counts are known only when the prefill ends (rank 0's worker reports them, vtprune's scheduler hands them
  over, :mod:`vtprune.vllm.layerwise.retention_scheduler`); the prompt is allocated whole, then each layer's blocks
  past its kept entries go back to vLLM's shared block pool (as vLLM's sliding-window manager frees blocks in the
  middle of a request), and later tokens are allocated after the kept entries.

vLLM seam (``vllm.v1.kv_cache_spec_registry``, ``vllm.v1.core.single_type_kv_cache_manager``): the attention layers of
region ``s >= 1`` report a :class:`PrunedAttentionSpec` (region ``s``) instead of a ``FullAttentionSpec``, so vLLM's
hybrid KV manager puts them in groups of their own; :class:`PrunedManager` gives a request ``tokens - pruned[s]``
slots there, ``pruned`` being the table the scheduler fills when the request arrives
(:class:`vtprune.vllm.layerwise.scheduler.PruningSchedulerMixin`). A request that prunes nothing is allocated (and
prefix-cached) as by full attention. The spec must not subclass ``FullAttentionSpec``: its ``merge`` would fold the
layers back into one group.

Importing this module registers the spec with vLLM's registry (after vLLM's own specs), in whichever process first
needs it: the worker that reports the specs, the engine core that unpickles them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class PrunedAttentionSpec(AttentionSpec):
    """Full attention over the tokens a layer region keeps (``region`` >= 1: after that many pruning stages)."""

    region: int = 1

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    def as_full(self) -> FullAttentionSpec:
        """The ``FullAttentionSpec`` of the same layout (what a request that prunes nothing sees)."""
        return FullAttentionSpec(**_layout(self))


@dataclass(frozen=True, kw_only=True)
class RetainedAttentionSpec(AttentionSpec):
    """Full attention over the entries one decoder layer (``layer``) retains under PrefixKV: a KV cache group per
    layer (no two layers are uniform, so vLLM never folds them into one group)."""

    layer: int = 0

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: Mapping[str, Any]) -> bool:
        return all(isinstance(spec, RetainedAttentionSpec) and spec.layer == self.layer
                   for spec in kv_cache_specs.values())

    def as_full(self) -> FullAttentionSpec:
        return FullAttentionSpec(**_layout(self))


class KeptSlotsManager(FullAttentionManager):
    """Full-attention bookkeeping over :meth:`_slots` token slots of a request (fewer than its tokens once pruned)."""

    def _slots(self, request_id: str, num_tokens: int) -> int:
        raise NotImplementedError

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        args = list(args)
        if len(args) >= 4:  # num_tokens_main_model (vLLM 0.31-0.33: the sixth positional argument)
            args[3] = self._slots(request_id, args[3])
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list:
        return super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens),
                                           self._slots(request_id, num_tokens_main_model))

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any) -> Any:
        """Prefix-cache hits of requests that prune nothing (pruned requests skip the lookup; their blocks are
        never cached), found as in full attention."""
        spec = kwargs.get("kv_cache_spec")
        if hasattr(spec, "as_full"):
            kwargs["kv_cache_spec"] = spec.as_full()
        return super().find_longest_cache_hit(*args, **kwargs)


class PrunedManager(KeptSlotsManager):
    """``tokens - pruned[region]`` slots per pruned request; no prefix-cache entries for pruned requests (their
    blocks hold a question-dependent selection)."""

    #: request id -> tokens missing in each region (region 0 first); set by the scheduler, empty until then
    pruned: Mapping[str, tuple[int, ...]] = types.MappingProxyType({})

    def _slots(self, request_id: str, num_tokens: int) -> int:
        missing = self.pruned.get(request_id)
        if not missing:
            return num_tokens
        return max(1, num_tokens - missing[self.kv_cache_spec.region])  # >= 1: a deferred chunk's placeholder row

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        if self.pruned.get(request.request_id):
            return
        super().cache_blocks(request, num_tokens, *args, **kwargs)


class RetainedManager(KeptSlotsManager):
    """A request's whole prompt until its prefill ends, then ``tokens - evicted[layer]`` slots: :meth:`release`
    hands the blocks past the layer's kept entries back to the pool. A request freed (finished, or preempted: its
    recompute prefills the whole prompt again) forgets its counts."""

    #: request id -> entries each layer evicted (layer 0 first); set by the scheduler when a prefill ends
    evicted: Mapping[str, tuple[int, ...]] = types.MappingProxyType({})

    def _slots(self, request_id: str, num_tokens: int) -> int:
        evicted = self.evicted.get(request_id)
        if evicted is None:
            return num_tokens
        return max(1, num_tokens - evicted[self.kv_cache_spec.layer])

    def release(self, request_id: str, num_tokens: int) -> int:
        """Return to the pool the request's blocks past ``cdiv(_slots(num_tokens), block)``; how many went back."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        keep = cdiv(self._slots(request_id, num_tokens), self.block_size)
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def pop_blocks_for_free(self, request_id: str) -> list:
        if isinstance(self.evicted, dict):
            self.evicted.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


KVCacheSpecRegistry._ensure_registered()  # vLLM's own specs first: registering ours must not pre-empt them
KVCacheSpecRegistry.register(PrunedAttentionSpec, PrunedManager, uniform_type_base_spec=PrunedAttentionSpec)
KVCacheSpecRegistry.register(RetainedAttentionSpec, RetainedManager, uniform_type_base_spec=RetainedAttentionSpec)


def _layout(spec: Any) -> dict:
    """The ``AttentionSpec`` fields of ``spec`` (block size, heads, head size, dtype, ...)."""
    return {f.name: getattr(spec, f.name) for f in fields(AttentionSpec) if f.init}


def derived_spec(spec: Any, kind: type, **extra: int) -> Any:
    """A ``kind`` spec (:class:`PrunedAttentionSpec`, :class:`RetainedAttentionSpec`) with the layout of a layer's
    ``FullAttentionSpec`` and ``extra`` (its region or layer); other attention types refused in one line."""
    if not isinstance(spec, FullAttentionSpec) or spec.sliding_window is not None or spec.attention_chunk_size:
        raise ValueError(f"vtprune: layer-wise pruning and prefixkv need full-attention layers; this model has "
                         f"{spec!r}.")
    return kind(**_layout(spec), **extra)


def _report_specs(attention_layers: Mapping[int, Any], kind: type, extra_of_layer: Any) -> None:
    """Make the attention module of decoder layer ``i`` (``attention_layers[i]``, vLLM's ``Attention``) report a
    ``kind`` spec with ``extra_of_layer(i)`` (None: its own spec); an instance attribute, the class is untouched."""
    for index, attention in attention_layers.items():
        extra = extra_of_layer(index)
        if extra is None:
            continue
        stock = attention.get_kv_cache_spec

        def get_kv_cache_spec(vllm_config: Any, _stock: Any = stock, _extra: dict = extra) -> Any:
            return derived_spec(_stock(vllm_config), kind, **_extra)

        attention.get_kv_cache_spec = get_kv_cache_spec


def use_pruned_specs(attention_layers: Mapping[int, Any], region_of_layer: Any) -> None:
    """The layers of regions ``>= 1`` report a :class:`PrunedAttentionSpec` of their region."""
    _report_specs(attention_layers, PrunedAttentionSpec,
                  lambda index: {"region": region} if (region := region_of_layer(index)) else None)


def use_retained_specs(attention_layers: Mapping[int, Any]) -> None:
    """Every decoder layer ``i`` reports a :class:`RetainedAttentionSpec` of layer ``i`` (PrefixKV: a KV cache group
    per layer)."""
    _report_specs(attention_layers, RetainedAttentionSpec, lambda index: {"layer": index})
