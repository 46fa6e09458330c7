"""The plugin's selection: which rows of one image's (or video's) LLM-input embeddings stay. Pure tensor functions.

One implementation: the ranking is vtprune's own (:func:`vtprune.methods.divprune.max_min_order` on
:func:`~vtprune.methods.divprune.cosine_distance`, :func:`vtprune.methods.baselines.random_values`,
:func:`vtprune.methods.temporal.temporal_scores`); this module only applies it to one vLLM multimodal item.
``divprune`` / ``random``: each frame (temporal patch) of an item keeps ``keep_count(keep, n_frame)`` rows, an
image (one frame) ``keep_count(keep, n)``. ``temporal`` (video only): the video keeps ``keep_count(keep, n)`` rows
over all its frames, the most changed since the previous frame (vtprune's rule); an image (one frame) has no
previous frame and stays whole. ``temporal_evs`` (``"count": "evs"``): the same scores counted as vLLM's EVS counts
(``max(h * w, int(n * keep))``, never below one frame). The count is a function of the grid, the method and ``keep`` alone, so vLLM's
front end reserves exactly that many placeholders before the tower runs.
The result depends only on the embeddings, ``keep``, the grid and the seed (no global state), so every
tensor-parallel rank that sees the same embeddings selects the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vtprune.config import keep_count


def frame_sizes(num_rows: int, frames: int | Sequence[int] = 1) -> list[int]:
    """Rows of each group of an item of ``num_rows`` rows: ``frames`` equal temporal patches, or ``frames`` given
    as the groups' sizes (LLaVA-NeXT / OneVision: the base view, then the tile grid with its newline column)."""
    if not isinstance(frames, int):
        sizes = [int(size) for size in frames]
        if sum(sizes) != num_rows or min(sizes, default=0) <= 0:
            raise ValueError(f"vtprune: groups {sizes} do not split an item of {num_rows} rows.")
        return sizes
    if frames <= 1 or num_rows % frames:
        return [num_rows]
    return [num_rows // frames] * frames


#: Methods whose budget is the whole item (all frames together), not each frame's own share.
ITEM_BUDGET = ("temporal", "temporal_evs")


def image_groups(config: Any, num_rows: int) -> list[int]:
    """``[base, tiles]`` rows of one packed image of ``num_rows`` rows (one group if there is no tile part, or
    if the base view keeps CLIP's class token, which vtprune's adapter cannot split either)."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    base = side * side
    with_cls = config.vision_feature_select_strategy == "full" and vision.model_type == "clip_vision_model"
    return [num_rows] if with_cls or num_rows <= base else [base, num_rows - base]


def _check_frames(method: str, frames: int | Sequence[int]) -> None:
    """Whole-item methods rank a video of equal frames (temporal patches), not an item's other groups."""
    if not isinstance(frames, int):
        raise ValueError(f"vtprune: method {method!r} runs on videos of equal frames (Qwen-VL), not on an image's "
                         "base view and tiles; use 'divprune' or 'random'.")


def evs_count(keep: float, num_rows: int, frames: int) -> int:
    """vLLM's EVS count of a video of ``frames`` equal frames at pruning rate ``q = 1 - keep``:
    ``max(rows per frame, int(num_rows * (1 - q)))``."""
    return max(num_rows // frames, int(num_rows * (1 - (1 - keep))))


def kept_count(keep: float, num_rows: int, frames: int | Sequence[int] = 1, method: str = "divprune") -> int:
    """Rows an item keeps: ``sum_f keep_count(keep, n_f)`` over its frames (one frame for an image);
    ``keep_count(keep, n)`` over the whole item for :data:`ITEM_BUDGET` methods (all ``n`` for an image)."""
    if method in ITEM_BUDGET:
        _check_frames(method, frames)
        if len(frame_sizes(num_rows, frames)) == 1:
            return num_rows
        return evs_count(keep, num_rows, frames) if method == "temporal_evs" else keep_count(keep, num_rows)
    return sum(keep_count(keep, n) for n in frame_sizes(num_rows, frames))


def temporal_rows(embeddings: torch.Tensor, keep: float, frames: int, evs: bool = False) -> torch.Tensor:
    """Indices ``[keep_count(keep, n)]`` (``[evs_count(...)]`` with ``evs``; unsorted) of one video's rows
    ``[n, D]`` of ``frames`` equal frames with the highest :func:`vtprune.methods.temporal.temporal_scores`
    (first frame first; ties: the earlier row)."""
    from vtprune.adapters.base import VisualSegment
    from vtprune.methods.temporal import previous_positions, temporal_scores

    n = embeddings.shape[0]
    if frames <= 1 or n % frames:
        raise ValueError(f"vtprune: method 'temporal' needs a video of several frames (temporal patches), got "
                         f"{frames} frame(s) of {n} rows; use 'divprune' for images.")
    per = n // frames
    previous = previous_positions([VisualSegment(0, frames, per, 1, kind="video")], n)
    scores = temporal_scores(embeddings, previous)
    count = evs_count(keep, n, frames) if evs else keep_count(keep, n)
    return torch.sort(-scores, stable=True).indices[:count]


def select_rows(method: str, embeddings: torch.Tensor, keep: float, frames: int | Sequence[int] = 1, seed: int = 0
                ) -> torch.Tensor:
    """Sorted indices ``[kept_count(keep, n, frames)]`` (long) of the rows of ``embeddings`` ``[n, D]`` to keep.

    ``frames``: equal temporal patches, or the sizes of the item's groups (:func:`frame_sizes`).
    ``divprune``: each frame keeps its first ``keep_count`` greedy max-min picks (cosine distance);
    ``random``: each frame keeps its rows with the highest seeded random values (ties: the earlier row);
    ``temporal`` / ``temporal_evs``: :func:`temporal_rows` over the whole item.
    """
    if method in ITEM_BUDGET:
        _check_frames(method, frames)
        if len(frame_sizes(embeddings.shape[0], frames)) == 1:  # an image: no previous frame, kept whole
            return torch.arange(embeddings.shape[0], device=embeddings.device)
        rows = temporal_rows(embeddings, keep, frames, evs=method == "temporal_evs")
        return torch.sort(rows.to(embeddings.device)).values
    from vtprune.methods.baselines import random_values
    from vtprune.methods.divprune import cosine_distance, max_min_order

    picks, start = [], 0
    for size in frame_sizes(embeddings.shape[0], frames):
        quota = keep_count(keep, size)
        if method == "divprune":
            local = max_min_order(cosine_distance(embeddings[start:start + size]), quota)
        elif method == "random":
            values = random_values(size, seed).to(embeddings.device)
            local = torch.sort(-values, stable=True).indices[:quota]
        else:
            raise ValueError(f"vtprune: no vLLM selection for method {method!r}.")
        picks.append(local.to(embeddings.device) + start)
        start += size
    return torch.sort(torch.cat(picks)).values


def truncate_runs(tokens: Sequence[int], token: int, keep: float) -> list[int]:
    """``tokens`` with each run of ``token`` cut to its first ``keep_count(keep, run)``: a Qwen3-VL video
    placeholder (a timestamp, ``<|vision_start|>``, one frame's tokens, ``<|vision_end|>``, per frame) that
    keeps each frame's share."""
    out: list[int] = []
    run = 0
    for value in list(tokens) + [None]:
        if value == token:
            run += 1
            continue
        out.extend([token] * keep_count(keep, run))
        run = 0
        if value is not None:
            out.append(value)
    return out


def frame_offsets(grid: tuple[int, int, int]) -> torch.Tensor:
    """``[t*h*w, 3]`` long offsets of a Qwen3-VL video of ``t`` frames: every frame restarts at ``(0, y, x)``
    (a timestamp between frames carries the time, each frame is numbered as a one-frame image)."""
    offsets = grid_offsets(grid)
    offsets[:, 0] = 0
    return offsets


def top_rows(values: torch.Tensor, keep: float) -> torch.Tensor:
    """Sorted indices ``[keep_count(keep, n)]`` of the highest of ``values`` ``[n]`` (ties: the earlier row), as
    vtprune's engine keeps a pre-LLM stage's top scores (VFlowOpt's importance without recycling)."""
    order = torch.sort(-values.float(), stable=True).indices[:keep_count(keep, values.shape[0])]
    return torch.sort(order).values


def visionzip_rows(attention: torch.Tensor, keys: torch.Tensor, embeddings: torch.Tensor, keep: float,
                   contextual: float | None = None, value: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """VisionZip on one image: sorted kept rows ``[k]`` (long) and their values ``[k, D]``, ``k = keep_count(keep, n)``.

    attention: ``[n]`` the attention each token receives at the scored tower layer; keys: ``[n, d]`` that layer's
    head-mean keys; embeddings: ``[n, D]`` the image's LLM-input rows. The ``k - c`` most attended rows stay as
    they are (ties: the earlier row), ``c = contextual_count(k, contextual, n - k)``; the rest merge into ``c``
    contextual rows (:func:`vtprune.methods.visionzip.contextual_merge`, written in the targets' rows), as
    :meth:`vtprune.methods.visionzip.VisionZip.merge` does for one image.
    """
    from vtprune.methods.visionzip import PAPER_CONTEXTUAL, contextual_count, contextual_merge

    n = embeddings.shape[0]
    kept = keep_count(keep, n)
    fraction = PAPER_CONTEXTUAL if contextual is None else float(contextual)
    extra = contextual_count(kept, fraction, n - kept)
    order = torch.sort(-attention.float(), stable=True).indices.to(embeddings.device)
    dominant = order[:kept - extra]
    if extra == 0:
        rows = torch.sort(dominant).values
        return rows, embeddings[rows]
    rest = torch.ones(n, dtype=torch.bool, device=embeddings.device)
    rest[dominant] = False
    rest = rest.nonzero().flatten()
    index, merged = contextual_merge(embeddings[rest], keys.to(embeddings.device)[rest], extra, value)
    values = embeddings.clone()
    values[rest[index]] = merged.to(embeddings.dtype)
    rows = torch.sort(torch.cat([dominant, rest[index]])).values
    return rows, values[rows]


def vispruner_rows(attention: torch.Tensor, features: torch.Tensor, keep: float) -> torch.Tensor:
    """VisPruner (ICCV 2025, arXiv:2412.01818) on one image or frame: sorted kept rows ``[keep_count(keep, n)]``.

    attention: ``[n]`` the attention each token receives at the scored tower layer; features: ``[n, D]`` what the
    diverse rounds compare (LLaVA: the feature layer's output before the projector; Qwen-VL: the LLM-input
    embeddings). vtprune's :func:`vtprune.methods.vispruner.important_diverse` at the release's ratio.
    """
    from vtprune.methods.vispruner import RELEASED_RATIO, important_diverse

    picks = important_diverse(attention, features.to(attention.device), keep_count(keep, attention.shape[0]),
                              RELEASED_RATIO)
    return torch.sort(picks).values


def scope_rows(attention: torch.Tensor, features: torch.Tensor, keep: float) -> torch.Tensor:
    """SCOPE (NeurIPS 2025, arXiv:2510.24214) on one image or frame: sorted kept rows ``[keep_count(keep, n)]``.

    attention: ``[n]`` the saliency, the attention each token receives at the scored tower layer; features:
    ``[n, D]`` what the coverage compares (as :func:`vispruner_rows`' features). vtprune's
    :func:`vtprune.methods.scope.saliency_coverage_order` at the release's alpha: its first picks.
    """
    from vtprune.methods.scope import RELEASED_ALPHA, saliency_coverage_order

    picks = saliency_coverage_order(attention, features.to(attention.device), keep_count(keep, attention.shape[0]),
                                    RELEASED_ALPHA)
    return torch.sort(picks).values


def hiprune_rows(shallow: torch.Tensor, deep: torch.Tensor, keep: float, width: int) -> torch.Tensor:
    """HiPrune (arXiv:2508.00553) on one image or frame: sorted kept rows ``[keep_count(keep, n)]``.

    shallow, deep: ``[n]`` the attention each token receives at the object and the deep layer; width: the token
    grid's row length. vtprune's :func:`vtprune.methods.hiprune.hierarchical_select` at the release's alpha.
    """
    from vtprune.methods.hiprune import RELEASED_ALPHA, hierarchical_select

    picks = hierarchical_select(shallow, deep.to(shallow.device), keep_count(keep, shallow.shape[0]), width,
                                RELEASED_ALPHA)
    return torch.sort(picks).values


def grid_offsets(grid: tuple[int, int, int], t_factor: float = 1.0) -> torch.Tensor:
    """``[t*h*w, 3]`` long (t, h, w) M-RoPE offsets of every row of a merged grid, as Qwen-VL numbers them."""
    t, h, w = grid
    index = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
    index = index.reshape(3, -1)
    if t_factor != 1.0:
        index[0] = (index[0].double() * t_factor).long()
    return index.T.contiguous()


def grid_extent(grid: tuple[int, int, int], t_factor: float = 1.0) -> int:
    """Positions an item spans: text after it continues at ``base + extent`` (the unpruned model's rule)."""
    return int(grid_offsets(grid, t_factor).max()) + 1
