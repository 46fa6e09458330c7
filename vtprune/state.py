"""Per-call bookkeeping of the engine, data only: the layout each layer sees, the call's state, the statistics.

A :class:`CallState` lives from a prefill to the end of its decoding. Its prefill-only part (the call's
inputs, scores, the method's captures, the per-stage layer arguments) is dropped as soon as the prefill
returns (:meth:`CallState.finish_prefill`); what decoding needs is a few ``[B, L_s]`` masks and host ints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vtprune.adapters.base import VisualSegment


@dataclass
class CallStats:
    """What one prefill did: visual tokens per sample before pruning and kept after each stage.

    ``kept_indices[s][b]`` lists the visual tokens of sample ``b`` alive after stage ``s``, as ordinals in
    the sample's visual tokens (grid order: row-major per image, images in prompt order). With KV retention
    (``retained_kv``, PrefixKV) every decoder layer is a "stage": what its cache kept. It is kept for the
    most recent calls only (``wrap(..., record_indices=N)``, default 8); older entries of ``handle.stats``
    hold ``None`` there, so a long-lived handle stays small.
    """

    visual_tokens: list[int]
    stage_layers: list[int] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    retained_kv: bool = False
    timer: Any = field(default=None, repr=False)
    _forward_ms: float | None = field(default=None, repr=False)
    _kept_indices: list[list[list[int]]] | None = field(default_factory=list, repr=False)
    _pending: Any = field(default=None, repr=False)

    @property
    def kept_indices(self) -> list[list[list[int]]] | None:
        """``[stage][sample]`` kept visual ordinals (read from the device on first access, not in the forward)."""
        if self._pending is not None:
            ordinals, event = self._pending
            if event is not None:
                event.synchronize()
            self._kept_indices, self._pending = self.sorted_ordinals(ordinals), None
        return self._kept_indices

    @kept_indices.setter
    def kept_indices(self, value: list[list[list[int]]] | None) -> None:
        self._kept_indices, self._pending = value, None

    def defer_kept_indices(self, ordinals: list[torch.Tensor]) -> None:
        """Start copying the stages' ``[B, L_s]`` ordinals to the host without waiting for the device."""
        if not ordinals:
            self.kept_indices = []
            return
        event = None
        if ordinals[0].device.type == "cuda":
            copies = []
            for tensor in ordinals:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                copies.append(host.copy_(tensor, non_blocking=True))
            event = torch.cuda.Event()
            event.record()
            ordinals = copies
        self._pending = (list(ordinals), event)

    @staticmethod
    def sorted_ordinals(ordinals: list[torch.Tensor]) -> list[list[list[int]]]:
        """``[stage][sample]`` sorted visual ordinals alive after each stage (one host transfer for all stages).

        ordinals: per stage, ``[B, L_s]`` long, the visual ordinal of each slot of the stage's view (``-1``: none).
        """
        if not ordinals:
            return []
        widths = [o.shape[1] for o in ordinals]
        rows = torch.cat(ordinals, dim=1).tolist()
        result: list[list[list[int]]] = [[] for _ in widths]
        for row in rows:
            start = 0
            for stage, width in enumerate(widths):
                result[stage].append(sorted(x for x in row[start:start + width] if x >= 0))
                start += width
        return result

    @property
    def forward_ms(self) -> float | None:
        """Wall time of the prefill forward in ms (on CUDA from events, read without syncing the forward)."""
        if self._forward_ms is None and self.timer is not None:
            self._forward_ms, self.timer = self.timer.elapsed_ms(), None
        return self._forward_ms

    @forward_ms.setter
    def forward_ms(self, value: float | None) -> None:
        self._forward_ms, self.timer = value, None

    def as_dict(self) -> dict[str, Any]:
        return {
            "visual_tokens": self.visual_tokens,
            "stage_layers": self.stage_layers,
            "kept": self.kept,
            "kept_indices": self.kept_indices,
            "retained_kv": self.retained_kv,
            "forward_ms": self.forward_ms,
        }


class Timer:
    """Prefill wall time: ``perf_counter`` on CPU, CUDA events on GPU (no synchronisation inside the call)."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.started, self.stopped = time.perf_counter(), None

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.stopped = time.perf_counter()

    def elapsed_ms(self) -> float | None:
        if self.events is not None:
            self.events[1].synchronize()
            return float(self.events[0].elapsed_time(self.events[1]))
        return None if self.stopped is None else (self.stopped - self.started) * 1000.0


@dataclass
class StageView:
    """The sequence seen by the layers of one stage, relative to the language model's input.

    ``index`` ``[B, L_s]`` points into the LM input positions, ``valid`` marks real slots; ``lengths`` (host)
    is the number of valid slots per sample, ``alive`` (host) and ``alive_count`` (``[B]`` on the device) the
    number of its visual tokens still alive; ``kwargs`` caches the sliced layer arguments (mask, cos/sin,
    position ids) built once per stage during prefill.
    """

    index: torch.Tensor
    valid: torch.Tensor
    visual: torch.Tensor
    ordinal: torch.Tensor
    lengths: list[int]
    alive: list[int]
    alive_count: torch.Tensor
    kwargs: dict[str, Any] = field(default_factory=dict)
    index_in_previous: torch.Tensor | None = None

    @property
    def padded(self) -> bool:
        """True when some slot is padding (the samples' lengths differ, or the width exceeds them)."""
        return min(self.lengths, default=0) != self.index.shape[1]


@dataclass
class StageRecord:
    """What one stage of a prefill did, for observers (``handle.observe``): the scores ``[B, L]`` of the slots
    it ranked (taken at decoder layer ``score_layer``, -1 before the LLM), the ``kept`` mask ``[B, L]`` (after
    any merge step), which slots were ``visual`` and their ``ordinal`` in the sample's visual tokens (``-1``
    elsewhere), the visual tokens kept per sample (``counts``) out of ``visual_tokens``, and ``merged``: kept
    slots a merge step rewrote (or None)."""

    stage: Any
    score_layer: int
    scores: torch.Tensor
    kept: torch.Tensor
    visual: torch.Tensor
    ordinal: torch.Tensor
    counts: list[int]
    visual_tokens: list[int]
    merged: torch.Tensor | None = None


@dataclass
class DecodeRegion:
    """What a decode step needs for the layers of one in-LM stage: its kept slots ``valid`` ``[B, L_s]``."""

    valid: torch.Tensor
    padded: bool
    removed: torch.Tensor | None = None


@dataclass
class CallState:
    """Everything the hooks share during one prefill and the decode steps that follow it."""

    num_visual: torch.Tensor
    visual_counts: list[int]
    prompt_length: int
    stats: CallStats
    stage_counts: torch.Tensor | None = None
    planned: list[list[int]] = field(default_factory=list)
    segments: list[list[VisualSegment]] | None = None
    inputs: dict[str, Any] | None = None
    visual: torch.Tensor | None = None
    ordinal: torch.Tensor | None = None
    method_state: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, torch.Tensor] = field(default_factory=dict)  # the call's own copies of labels= / shift_labels=
    text_counts: list[int] = field(default_factory=list)
    stage_ordinals: list[torch.Tensor] = field(default_factory=list)
    left_padding: bool = True
    views: list[StageView] = field(default_factory=list)
    base_count: torch.Tensor | None = None
    next_stage: int = 0
    pending_scores: torch.Tensor | None = None
    pre_llm_index: torch.Tensor | None = None
    cache_problem: str | None = None  # the kind of an unsupported cache passed to this prefill (refused if it prunes)
    # decode
    abandoned: bool = False
    decoding: bool = False
    decoded: int = 0
    pre_llm_valid: torch.Tensor | None = None
    pre_llm_padded: bool = False
    pre_llm_removed: torch.Tensor | None = None  # [B] tokens a compact pre-LLM stage removed (else None)
    regions: list[DecodeRegion] = field(default_factory=list)
    decode_columns: torch.Tensor | None = None
    step: dict[Any, Any] = field(default_factory=dict)
    kv_decode: dict[str, Any] | None = None
    model_state: dict[str, Any] | None = None  # what the model kept of this prefill (Adapter.conversation_state)
    cache_pruned: bool = False  # the prefill left the cache without some of its entries (it is marked so)

    @property
    def view(self) -> StageView | None:
        """The view of the deepest stage reached so far (prefill)."""
        return self.views[-1] if self.views else None

    def finish_prefill(self, compact: bool) -> None:
        """Keep only what decoding needs; drop inputs, captures, scores and the per-stage layer arguments."""
        for view in self.views[1:] if not self.regions else ():  # KV retention set its own per-layer regions
            removed = (self.base_count - view.valid.sum(dim=1))[:, None] if compact else None
            self.regions.append(DecodeRegion(valid=view.valid, padded=view.padded, removed=removed))
        self.inputs, self.segments, self.visual, self.ordinal, self.labels = None, None, None, None, {}
        self.method_state, self.views, self.pending_scores, self.pre_llm_index = {}, [], None, None
        self.stage_ordinals = []


class LazySegments(Sequence):
    """The call's per-sample segments, computed on first use (most methods never need them)."""

    def __init__(self, compute: Callable[[], list]) -> None:
        self._compute: Callable[[], list] | None = compute
        self._value: list | None = None

    def _get(self) -> list:
        if self._value is None:
            self._value, self._compute = self._compute(), None
        return self._value

    def __getitem__(self, index: Any) -> Any:
        return self._get()[index]

    def __len__(self) -> int:
        return len(self._get())
