"""What a layer-wise method needs to know of one vLLM request, read from its multimodal features the same way in the
scheduler (KV allocation) and in the workers (compaction): its visual tokens and its keep.

A feature is vLLM's ``MultiModalFeatureSpec``: ``modality``, ``mm_position`` (a ``PlaceholderRange``: ``offset``,
``length``, ``is_embed``) and ``data`` (the item's tensors, with vtprune's keep field in parts per million).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vtprune.vllm.layerwise.plan import LayerPlan

PPM = 1_000_000
MODALITIES = ("image", "video")


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


def request_keep(features: Sequence[Any], default: float) -> float:
    """The request's keep: the keep field its items carry (``mm_processor_kwargs['vtprune_keep']`` or the model's,
    set by the front end), else ``default``."""
    for feature in features:
        data = getattr(feature, "data", None)
        field = f"vtprune_keep_{feature.modality}"
        if data is not None and field in data:
            return int(torch.as_tensor(data[field].data).reshape(-1)[0]) / PPM
    return default


def pruned_table(plan: LayerPlan, features: Sequence[Any], default_keep: float) -> tuple[int, ...]:
    """Tokens the request misses in each layer region (region 0 first); all zeros when it prunes nothing."""
    count = int(visual_positions(features).numel())
    if count == 0:
        return (0,) * (len(plan.stages) + 1)
    return plan.pruned_counts(count, request_keep(features, default_keep))
