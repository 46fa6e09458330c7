"""What the pruned LLaVA and Qwen-VL classes share inside vLLM (imports vLLM; loaded only by vLLM's registry).

* :class:`PrunedProcessorMixin` (front end): every multimodal item carries its keep fraction
  (``vtprune_keep_<modality>``, parts per million, from ``mm_processor_kwargs['vtprune_keep']`` or the model's
  setting) and the prompt gets ``kept_count`` placeholders per item instead of all of them.
* :class:`PrunedModelMixin` (workers): reads and checks the settings at start-up and keeps the selected rows of
  each item (:func:`vtprune.vllm.select.select_rows`), identical on every tensor-parallel rank.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vtprune.vllm import ranks
from vtprune.vllm.select import ITEM_BUDGET, kept_count, select_rows
from vtprune.vllm.settings import (
    IMAGE_METHODS,
    REQUEST_KEY,
    TOWER_FAMILIES,
    TOWER_METHODS,
    VllmPruning,
    check_vllm_version,
    processor_keys,
)

PPM = 1_000_000


def keep_field(modality: str) -> str:
    """Name of the per-item keep field of ``modality`` (travels with the item's tensors)."""
    return f"vtprune_keep_{modality}"


def without_request_key(kwargs: Mapping[str, object]) -> dict[str, object]:
    """``kwargs`` without vtprune's request key (the HF processor never sees it)."""
    return {key: value for key, value in kwargs.items() if key != REQUEST_KEY}


#: modality -> the ``embed_multimodal`` keyword arguments that carry its items (pixels or precomputed embeddings)
MODALITY_KEYS = {"image": ("pixel_values", "image_embeds"), "video": ("pixel_values_videos", "video_embeds")}


def modality_order(kwargs: Mapping[str, object]) -> list[str]:
    """The modalities of an ``embed_multimodal`` call in the order vLLM's models return their items (the order
    of their keyword arguments)."""
    return list(dict.fromkeys(m for key in kwargs for m, keys in MODALITY_KEYS.items() if key in keys))


def item_keeps(values: Any, count: int, default: float) -> list[float]:
    """``count`` keep fractions from a batched ppm field (``None``: the model's default)."""
    if values is None:
        return [default] * count
    flat = torch.as_tensor(values).reshape(-1).tolist() if not isinstance(values, list) else [
        float(torch.as_tensor(v).reshape(-1)[0]) for v in values]
    return [int(v) / PPM for v in flat]


class PrunedProcessorMixin:
    """Front-end side: a keep field per item and ``kept_count`` placeholders per item."""

    #: the modalities this family prunes (each item gets a keep field and ``kept_count`` placeholders)
    modalities: tuple[str, ...] = ("image",)
    #: the tower-attention methods (:data:`~vtprune.vllm.settings.TOWER_METHODS`) this family runs
    tower_methods: tuple[str, ...] = ()
    #: whether this family's videos arrive as equal frames (temporal patches) that ``temporal`` can rank
    frame_videos: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_vllm_version()
        method = self.vtprune_settings().method  # refuse bad settings when vLLM builds the processor (at start-up)
        if method in TOWER_METHODS and method not in self.tower_methods:
            raise ValueError(f"vtprune: method {method!r} reads the vision tower's attention, which the plugin "
                             f"recomputes inside vLLM's tower for {TOWER_FAMILIES[method]} only; serve 'divprune' or "
                             "'random' here.")
        videos = self.info.ctx.get_mm_config().get_limit_per_prompt("video") if "video" in self.modalities else 0
        if method in IMAGE_METHODS and videos > 0:
            raise ValueError(f"vtprune: method {method!r} scores images only (as vtprune's transformers path); start "
                             "vLLM with limit_mm_per_prompt={'video': 0} (vtprune serve does), or serve 'divprune' "
                             "for video.")
        rate = getattr(self.info.ctx.get_mm_config(), "video_pruning_rate", None)
        if rate:
            raise ValueError(f"vtprune: video_pruning_rate={rate} turns on vLLM's own video pruning (EVS) on a model "
                             "vtprune already prunes; drop it, or serve method 'temporal' with count='evs' (EVS's "
                             "count with vtprune's rule).")
        if method in ITEM_BUDGET and not self.frame_videos:
            raise ValueError(f"vtprune: method {method!r} prunes tokens repeated across video frames, which the "
                             "plugin does for Qwen2-VL / Qwen2.5-VL video only; serve 'divprune' or 'random' here.")

    def vtprune_settings(self) -> VllmPruning:
        return VllmPruning.from_config(self.info.get_hf_config())

    def item_groups(self, item: Any, modality: str, num_rows: int) -> int | list[int]:
        """The groups of an item of ``num_rows`` placeholders, each keeping its own share: a number of equal
        temporal patches (1 for an image), or the groups' sizes (:func:`~vtprune.vllm.select.frame_sizes`)."""
        return 1

    def request_options(self) -> frozenset[str] | None:
        """The ``mm_processor_kwargs`` keys the model's transformers processor takes (read once), or None when it
        declares none (nothing is refused then)."""
        if not hasattr(self, "_vtprune_options"):
            self._vtprune_options = processor_keys(self.info.get_hf_processor()) or None
        return self._vtprune_options

    def _apply_hf_processor_main(self, mm_items: Any, hf_kwargs: Mapping[str, object]):
        """The stock processing (without vtprune's request key; OneVision runs its HF processor from here, not
        through ``_call_hf_processor``) plus a keep field per item."""
        # refuses a bad keep, or a key neither vtprune's nor the processor's (``ratio``), before any work
        keep = self.vtprune_settings().request_keep(dict(hf_kwargs), self.request_options())
        out = super()._apply_hf_processor_main(mm_items, without_request_key(hf_kwargs))
        for modality, count in mm_items.get_all_counts().items():  # pixels and precomputed embeddings alike
            if modality in self.modalities and count:
                out[keep_field(modality)] = torch.full((count,), round(keep * PPM), dtype=torch.long)
        return out

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]):
        from vllm.multimodal.inputs import MultiModalFieldConfig

        config = dict(super()._get_mm_fields_config(hf_inputs, without_request_key(hf_processor_mm_kwargs)))
        for modality in self.modalities:
            config[keep_field(modality)] = MultiModalFieldConfig.batched(modality, keep_on_cpu=True)
        return config

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: Any) -> Sequence[Any]:
        updates = super()._get_prompt_updates(mm_items, without_request_key(hf_processor_mm_kwargs), out_mm_kwargs)
        if self.vtprune_settings().layer_wise:  # every visual token enters the language model
            return updates
        return [self._pruned_update(update, out_mm_kwargs) for update in updates]

    def _pruned_update(self, update: Any, out_mm_kwargs: Any) -> Any:
        inner, modality = update.replacement, update.modality

        def replacement(item_idx: int) -> list[int]:
            tokens = inner(item_idx) if callable(inner) else inner
            if not isinstance(tokens, list):
                raise TypeError(f"vtprune: unexpected placeholder replacement {type(tokens).__name__}.")
            item = out_mm_kwargs[modality][item_idx]
            keep = int(item[keep_field(modality)].data) / PPM
            method = self.vtprune_settings().selection
            return tokens[:kept_count(keep, len(tokens), self.item_groups(item, modality, len(tokens)), method)]

        return dataclasses.replace(update, replacement=replacement)


def find_runner() -> Any:
    """vLLM's model runner that is building this model (found on the call stack), or ``None``."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "is_multimodal_pruning_enabled") and hasattr(owner, "uses_mrope"):
            return owner
        frame = frame.f_back
    return None


class PrunedModelMixin:
    """Worker side: checked settings and rank-identical selection of each item's rows."""

    def vtprune_init(self, vllm_config: Any, needs_runner: bool = False) -> None:
        check_vllm_version()
        self.vtprune = VllmPruning.from_config(vllm_config.model_config.hf_config)
        if self.vtprune.method in TOWER_METHODS and vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(f"vtprune: {self.vtprune.method} in vLLM reads the tower's attention from one rank's "
                             "heads; serve it with tensor_parallel_size=1 (or serve 'divprune' with tensor "
                             "parallelism).")
        if self.vtprune.method in TOWER_METHODS and getattr(vllm_config.compilation_config, "compile_mm_encoder", False):
            raise ValueError(f"vtprune: {self.vtprune.method} reads the tower's attention through a hook, which a "
                             "compiled vision encoder skips; leave compile_mm_encoder off (or serve 'divprune').")
        needs_runner = needs_runner or self.vtprune.layer_wise
        runner = find_runner() if needs_runner else None
        if needs_runner and runner is None:
            raise RuntimeError("vtprune: vLLM's model runner was not found while the model was built, so kept "
                               "tokens could not get their original M-RoPE positions (untested vLLM version?).")
        self._vtprune_runner = weakref.ref(runner) if runner is not None else None
        #: the kept row indices of the most recent items (bounded; read in tests through ``LLM.apply_model``)
        self.vtprune_selections: collections.deque[list[int]] = collections.deque(maxlen=256)
        self.vtprune_layerwise = self._layer_wise(vllm_config, runner) if self.vtprune.layer_wise else None

    def _layer_wise(self, vllm_config: Any, runner: Any) -> Any:
        """The hooks of a layer-wise method on this model's language model (:mod:`vtprune.vllm.layerwise`), and its
        pruned layers' own KV specs."""
        from vtprune.vllm.settings import is_retention

        if is_retention(self.vtprune.method):  # PrefixKV: every layer keeps its own KV entries
            from vtprune.vllm.layerwise import kv
            from vtprune.vllm.layerwise.config import served_retention
            from vtprune.vllm.layerwise.retention import RetentionRuntime

            scorer = served_retention(vllm_config.model_config)
            runtime = RetentionRuntime(self, scorer, self.vtprune.keep, runner, self.vtprune_selections)
            kv.use_retained_specs(dict(enumerate(runtime.attention)))
            return runtime
        from vtprune.vllm.layerwise import kv
        from vtprune.vllm.layerwise.config import served_plan
        from vtprune.vllm.layerwise.runtime import LayerwiseRuntime

        plan = served_plan(vllm_config.model_config)
        runtime = LayerwiseRuntime(self, plan, self.vtprune.keep, runner, self.vtprune_selections)
        kv.use_pruned_specs({i: layer.self_attn.attn for i, layer in enumerate(runtime.layers.decoder_layers)},
                            plan.region_of_layer)
        return runtime

    def enable_position_updates(self) -> None:
        """Make the runner call :meth:`recompute_mrope_positions` (vLLM does so only for EVS video pruning)."""
        runner = self._vtprune_runner() if self._vtprune_runner is not None else None
        if runner is not None:
            runner.is_multimodal_pruning_enabled = True

    def prune_items(self, embeddings: Sequence[torch.Tensor], kwargs: dict, keeps: dict) -> list[torch.Tensor]:
        """Each item's kept rows ``[k_i, D]`` of the stock ``embeddings`` of a call, in their order; ``keeps``:
        the popped keep field of each modality; an item's groups come from :meth:`row_groups`."""
        if self.vtprune.layer_wise:  # the language model prunes (vtprune.vllm.layerwise)
            return list(embeddings)
        out, index = [], 0
        for modality in modality_order(kwargs):
            count = len(embeddings) - index if keeps.get(modality) is None else len(keeps[modality])
            for keep in item_keeps(keeps.get(modality), count, self.vtprune.keep):
                rows = embeddings[index]
                index += 1
                out.append(rows[self.vtprune_rows(rows, keep, self.row_groups(modality, rows.shape[0]))])
        return out

    def row_groups(self, modality: str, num_rows: int) -> int | list[int]:
        """The groups of an item of ``num_rows`` rows (the processor's :meth:`PrunedProcessorMixin.item_groups`)."""
        return 1

    def vtprune_rows(self, embeddings: torch.Tensor, keep: float, frames: int | Sequence[int] = 1) -> torch.Tensor:
        """Sorted kept row indices ``[k]`` of one item ``[n, D]`` (``frames``: its groups, as
        :meth:`PrunedProcessorMixin.item_groups`); tensor-parallel ranks use rank 0's."""
        rows = ranks.broadcast_from_first_rank(select_rows(self.vtprune.selection, embeddings, keep, frames,
                                                     self.vtprune.seed))
        self.vtprune_selections.append(rows.tolist())
        return rows


def recent_selections(model: Any) -> list[list[int]]:
    """The kept rows of the most recent items (``LLM.apply_model(recent_selections)``; for tests)."""
    return list(getattr(model, "vtprune_selections", []))


def clear_selections(model: Any) -> int:
    """Forget the recorded selections (``LLM.apply_model(clear_selections)``); returns how many there were."""
    records = getattr(model, "vtprune_selections", None)
    count = len(records) if records is not None else 0
    if records is not None:
        records.clear()
    return count
