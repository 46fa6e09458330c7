"""Pure tensor functions of the criteria (tensor in, tensor out; tested without a model).

* TransPrune (arXiv:2507.20630): token transition variation (TTV) and score normalisation.
* VFlowOpt (arXiv:2508.05211): grid-cell recycling of pruned tokens.
"""

from __future__ import annotations

import torch

from vtprune.kernels import merge_tokens


# -- TransPrune ----------------------------------------------------------------------------------------------
def ttv_terms(t_in: torch.Tensor, t_out: torch.Tensor, abs_cos: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude ``||T_out|| / ||T_in||`` and direction term ``1 - cos`` (or ``1 - |cos|``), each ``[B, L]`` fp32.

    t_in: ``[B, L, D]`` the normalised input of a sub-block (``input_layernorm(x)`` / ``post_attention_layernorm(h)``);
    t_out: ``[B, L, D]`` its output before the residual add (``self_attn`` / ``mlp`` output).
    """
    t_in, t_out = t_in.float(), t_out.float()
    norm_in, norm_out = t_in.norm(dim=-1), t_out.norm(dim=-1)
    magnitude = norm_out / norm_in.clamp_min(1e-12)
    cos = (t_in * t_out).sum(dim=-1) / (norm_in * norm_out).clamp_min(1e-12)
    return magnitude, 1.0 - (cos.abs() if abs_cos else cos)


def masked_softmax(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the valid entries of each row ``[B, L]`` (0 on invalid ones; all-invalid rows give 0)."""
    logits = values.float().masked_fill(~valid, float("-inf"))
    out = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(out, nan=0.0)


def ttv(magnitude: torch.Tensor, direction: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``TTV_F = softmax_valid(direction) * magnitude`` ``[B, L]``; the softmax runs per sample over its valid tokens.

    (The released code normalises over the whole batch tensor; per sample makes a batch equal its samples.)
    """
    return masked_softmax(direction, valid) * magnitude.float().masked_fill(~valid, 0.0)


def normalise_alive(scores: torch.Tensor, alive: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``s / (sum_alive s + eps)`` per row ``[B, L]``, 0 outside ``alive`` (TransPrune Sec. 3.4)."""
    scores = scores.float().masked_fill(~alive, 0.0)
    return scores / (scores.sum(dim=-1, keepdim=True) + eps)


# -- VFlowOpt recycling ------------------------------------------------------------------------------------
def lowest_kept(importance: torch.Tensor, kept: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mask ``[B, L]`` of the ``count[b]`` kept slots with the lowest importance (ties: the later slot first)."""
    batch, length = importance.shape
    flipped = torch.flip(importance.float().masked_fill(~kept, float("inf")), dims=[1])
    order = torch.sort(flipped, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(length, device=order.device).expand(batch, length))
    chosen = torch.flip(rank, dims=[1]) < torch.minimum(count, kept.sum(dim=1))[:, None]
    return chosen & kept


def recycle(hidden: torch.Tensor, importance: torch.Tensor, candidate: torch.Tensor, cell: torch.Tensor,
            num_cells: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the ``candidate`` tokens of every cell into its most important member (VFlowOpt Sec. 3.3).

    hidden: ``[B, L, D]``; importance: ``[B, L]``; candidate: ``[B, L]`` bool (the pruned set ``P``);
    cell: ``[B, L]`` long cell id (``-1``: no cell, pruned without recycling).
    Each non-empty cell ``G`` gets ``sum_{i in G} I_i t_i / sum_{i in G} I_i`` (``vtprune.kernels.merge_tokens``)
    written into the slot of its highest-``I`` member (ties: the earlier slot). Negative importances
    (entropy weight ``alpha < 0``) count as 0; a cell whose weights are all 0 takes the plain mean.
    Returns the representative mask ``[B, L]`` (slots to keep) and the updated hidden states.
    ``num_cells`` (host int, > every cell id): given, nothing is read back from the device.
    """

    batch, length, dim = hidden.shape
    assign = torch.where(candidate & (cell >= 0), cell, torch.full_like(cell, -1))
    members = assign >= 0
    if num_cells is None:
        if not bool(members.any()):
            return torch.zeros_like(candidate), hidden
        num_cells = int(assign.max()) + 1
    targets = max(num_cells, 1)
    slot = assign.clamp(min=0)
    weight = importance.float().clamp_min(0.0).masked_fill(~members, 0.0)
    total = torch.zeros(batch, targets, device=hidden.device).scatter_add_(1, slot, weight)
    weight = torch.where(members & (total.gather(1, slot) <= 0), torch.ones_like(weight), weight)
    merged = merge_tokens(hidden, assign, weight, targets, check=False)
    score = importance.float().masked_fill(~members, float("-inf"))
    best = torch.full((batch, targets), float("-inf"), device=hidden.device)
    best = best.scatter_reduce(1, slot, score, reduce="amax", include_self=True)
    positions = torch.arange(length, device=hidden.device).expand(batch, length)
    top = members & (score == best.gather(1, slot))
    first = torch.full((batch, targets), length, dtype=torch.long, device=hidden.device)
    first = first.scatter_reduce(1, slot, torch.where(top, positions, length), reduce="amin", include_self=True)
    # Scatter without a data-dependent shape: cells with no member write to a dummy slot ``length``.
    slots = torch.where(first < length, first, torch.full_like(first, length))  # [B, T]
    representative = torch.zeros(batch, length + 1, dtype=torch.bool, device=hidden.device)
    representative = representative.scatter(1, slots, True)[:, :length]
    updated = torch.cat([hidden, hidden.new_zeros(batch, 1, dim)], dim=1)
    updated = updated.scatter(1, slots[..., None].expand(-1, -1, dim), merged.to(hidden.dtype))[:, :length]
    return representative, updated
