"""What a layer-wise method needs to know of one vLLM request, read from its multimodal features the same way in the
scheduler (KV allocation) and in the workers (compaction): its visual tokens and its keep.

A feature is vLLM's ``MultiModalFeatureSpec``: ``modality``, ``mm_position`` (a ``PlaceholderRange``: ``offset``,
``length``, ``is_embed``) and ``data`` (the item's tensors, with vtprune's keep field in parts per million).

The keep travels with the request itself too: vLLM strips the data of an item whose placeholders the prefix cache
already holds before the workers see it (``strip_covered_mm_data``; M-RoPE models keep their CPU fields, LLaVA keeps
none), so the scheduler, which sees every item whole, writes the request's keep into its sampling parameters
(:func:`carry_keep`, ``extra_args['vtprune_keep_ppm']``) and the workers read it there (:func:`carried_keep`). A
worker refuses a request whose items and carried keep disagree, or whose keep it cannot know, rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vtprune.vllm.layerwise.plan import LayerPlan

PPM = 1_000_000
MODALITIES = ("image", "video")
#: the key of a request's keep (parts per million) in its sampling parameters' ``extra_args`` (:func:`carry_keep`)
CARRIED_KEY = "vtprune_keep_ppm"


def visual_positions(features: Sequence[Any]) -> torch.Tensor:
    """``[N0]`` long: the prompt positions of the request's visual tokens (every image and video item's embedding
    positions; text inside a placeholder range, e.g. Qwen3-VL's frame timestamps, is not visual), ascending."""
    parts = []
    for feature in features:
        if feature.modality not in MODALITIES:
            continue
        place = feature.mm_position
        offsets = torch.arange(place.length, dtype=torch.long)
        if place.is_embed is not None:
            offsets = offsets[torch.as_tensor(place.is_embed, dtype=torch.bool)]
        parts.append(offsets + int(place.offset))
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts).sort().values


def items_keep(features: Sequence[Any]) -> float | None:
    """The keep field the request's items carry (``mm_processor_kwargs['vtprune_keep']`` or the model's, set by the
    front end), or None when no item carries one."""
    for feature in features:
        data = getattr(feature, "data", None)
        field = f"vtprune_keep_{feature.modality}"
        if data is not None and field in data:
            return int(torch.as_tensor(data[field].data).reshape(-1)[0]) / PPM
    return None


def request_keep(features: Sequence[Any], default: float, carried: float | None = None) -> float:
    """The request's keep: ``carried`` (the scheduler's, :func:`carried_keep`) if given, else its items' field, else
    ``default`` for a request without visual items. A ``RuntimeError`` of one line when the items and ``carried``
    disagree, or when a visual item's data was stripped and nothing carries the keep (never the default guessed)."""
    own = items_keep(features)
    if carried is not None:
        if own is not None and round(own * PPM) != round(carried * PPM):
            raise RuntimeError(f"vtprune: a request's items carry keep {own} but its scheduler planned keep {carried}; "
                               "refusing to prune it at either (report this with the vLLM version).")
        return carried
    if own is not None:
        return own
    if any(f.modality in MODALITIES and getattr(f, "data", None) is None for f in features):
        raise RuntimeError("vtprune: a request's multimodal data was stripped (prefix cache) and its keep was not "
                           "carried with it; serve layer-wise methods with vtprune's scheduler (drop scheduler_cls).")
    return default


def pruned_table(plan: LayerPlan, features: Sequence[Any], default_keep: float,
                 carried: float | None = None) -> tuple[int, ...]:
    """Tokens the request misses in each layer region (region 0 first); all zeros when it prunes nothing."""
    count = int(visual_positions(features).numel())
    if count == 0:
        return (0,) * (len(plan.stages) + 1)
    return plan.pruned_counts(count, request_keep(features, default_keep, carried))


def carry_keep(request: Any, keep: float) -> None:
    """Write ``keep`` into the scheduler-side ``request``'s own sampling parameters (a new ``extra_args`` dict; vLLM
    clones the parameters per request), which reach the workers with the request whatever vLLM strips of its items."""
    params = getattr(request, "sampling_params", None)
    if params is not None:
        params.extra_args = {**(params.extra_args or {}), CARRIED_KEY: round(keep * PPM)}


def carried_keep(params: Any) -> float | None:
    """The keep :func:`carry_keep` wrote into a request's sampling parameters ``params``, or None."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(CARRIED_KEY)
    return None if value is None else int(value) / PPM
