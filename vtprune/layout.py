"""Pure tensor functions for the sequence layout after pruning: which positions survive, masks, gathers.

:func:`select_kept` picks each sample's top visual slots (``vtprune.kernels.segmented_topk``), :func:`repad`
packs a keep mask into a padded layout, :func:`gather_tokens` slices per-position tensors to it.

A *layout* describes the sequence a decoder layer sees after one or more pruning stages. Every sample
keeps its own tokens, so the kept lengths differ per sample; the layout re-pads them on the side the
input was padded (left padding keeps the last prompt token at index ``-1`` for ``generate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vtprune.kernels import segmented_topk


@dataclass
class Layout:
    """A padded batch of kept positions.

    Attributes
    ----------
    index: ``[B, L]`` long, the position in the *previous* layout each slot gathers (pads point at 0).
    valid: ``[B, L]`` bool, False on padding slots.
    """

    index: torch.Tensor
    valid: torch.Tensor

    @property
    def has_padding(self) -> bool:
        return not bool(self.valid.all())


def repad(kept: torch.Tensor, left: bool, new_length: int | None = None) -> Layout:
    """Pack the True positions of ``kept`` ``[B, L]`` into a padded layout, preserving their order.

    Left padding puts pads first so that every sample ends at index ``-1``; right padding puts them last.
    ``new_length`` (host int, optional) is the largest kept count; given, the function does not sync.
    """
    batch, length = kept.shape
    counts = kept.sum(dim=1)
    if new_length is None:
        new_length = int(counts.max()) if batch else 0
    positions = torch.arange(length, device=kept.device).expand(batch, length)
    # Stable sort keeps kept positions in order and moves the dropped ones behind them.
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :new_length]
    slot = torch.arange(new_length, device=kept.device).expand(batch, new_length)
    valid = slot < counts[:, None]
    if left:
        shift = (new_length - counts)[:, None]
        source = (slot - shift).clamp(min=0)
        order = torch.gather(order, 1, source)
        valid = slot >= shift
    index = torch.where(valid, torch.gather(positions, 1, order), torch.zeros_like(order))
    return Layout(index=index, valid=valid)


def gather_tokens(tensor: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather ``tensor`` along sequence dimension ``dim`` with a per-sample ``index`` ``[B, L']``.

    The batch dimension is the one right before ``dim`` (``[B, L, D]``, ``[B, L]``, ``[3, B, L]``); a batch
    dimension of size 1 is broadcast first. ``index`` is broadcast over every other dimension.
    """
    dim = dim % tensor.dim()
    batch_dim = max(dim - 1, 0)
    if tensor.shape[batch_dim] != index.shape[0]:
        # Broadcast tensors such as cos/sin computed from position ids of batch 1.
        sizes = list(tensor.shape)
        sizes[batch_dim] = index.shape[0]
        tensor = tensor.expand(*sizes)
    shape = [1] * tensor.dim()
    shape[batch_dim] = index.shape[0]
    shape[dim] = index.shape[1]
    sizes = [index.shape[1] if d == dim else tensor.shape[d] for d in range(tensor.dim())]
    expanded = index.view(shape).expand(*sizes)
    return torch.gather(tensor, dim, expanded.to(tensor.device))


def attention_mask_for(
    kv_valid: torch.Tensor, q_len: int, style: str, dtype: torch.dtype
) -> torch.Tensor:
    """Build the mask a decoder layer expects for keys ``kv_valid`` ``[B, K]`` and the last ``q_len`` queries.

    ``style`` is ``"bool"`` (SDPA: ``[B, 1, q, K]``, True attends), ``"float"`` (eager: additive, 0 or the
    dtype's minimum) or ``"2d"`` (flash attention: the ``[B, K]`` padding mask). Query ``i`` sits at key
    index ``K - q_len + i`` (causal). Rows with no valid key attend to every key, as transformers does, so
    padding rows stay finite.
    """
    if style == "2d":
        return kv_valid.long()
    kv_len = kv_valid.shape[1]
    query_at = torch.arange(kv_len - q_len, kv_len, device=kv_valid.device)
    causal = torch.arange(kv_len, device=kv_valid.device)[None, :] <= query_at[:, None]
    allowed = causal[None] & kv_valid[:, None, :]
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    allowed = allowed[:, None]
    if style == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=kv_valid.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def mask_style(incoming: object, attn_implementation: str) -> str:
    """The mask convention of a layer call: from the mask the model built, else from the attention kind."""
    if isinstance(incoming, torch.Tensor):
        if incoming.dim() == 2:
            return "2d"
        return "bool" if incoming.dtype == torch.bool else "float"
    if attn_implementation.startswith("flash"):
        return "2d"
    return "float" if attn_implementation == "eager" else "bool"


def repad_known(kept: torch.Tensor, left: bool, lengths: list[int]) -> Layout:
    """:func:`repad` with the kept lengths ``[B]`` known on the host (no device sync)."""
    return repad(kept, left, new_length=max(lengths, default=0))


def visual_ordinals(visual: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` long: the index of each visual slot among its sample's visual tokens, ``-1`` elsewhere."""
    ordinal = visual.long().cumsum(dim=1) - 1
    return torch.where(visual, ordinal, torch.full_like(ordinal, -1))


def select_kept(
    scores: torch.Tensor, visual: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
    width: int | None = None, k_max: int | None = None,
) -> torch.Tensor:
    """Kept mask ``[B, L]``: every valid text slot plus the top ``counts[b]`` alive visual slots by score.

    scores: ``[B, L]`` float; visual / valid: ``[B, L]`` bool; counts: ``[B]`` long; ``width`` (optional,
    host int) the largest number of alive visual slots of a sample and ``k_max`` the largest kept count:
    given both, nothing is read back from the device. Ties go to the earlier token
    (``vtprune.kernels.segmented_topk``).
    """

    batch, length = visual.shape
    alive = visual & valid
    lengths = alive.sum(dim=1)
    if width is None:
        width = int(lengths.max()) if batch else 0
    width = max(width, 1)
    order = torch.sort((~alive).to(torch.int8), dim=1, stable=True).indices[:, :width]
    slot_valid = torch.arange(width, device=visual.device)[None, :] < lengths[:, None]
    packed = torch.gather(scores.float(), 1, order).masked_fill(~slot_valid, 0.0)
    k = torch.minimum(counts.to(lengths.device), lengths)
    chosen = segmented_topk(packed, lengths, k, k_max=k_max, check=k_max is None)
    positions = torch.gather(order, 1, chosen.clamp(min=0))
    # Scatter without boolean indexing (no data-dependent shape): unpicked slots write to a dummy column.
    positions = torch.where(chosen >= 0, positions, torch.full_like(positions, length))
    chosen_mask = torch.zeros(batch, length + 1, dtype=torch.bool, device=visual.device)
    chosen_mask.scatter_(1, positions, True)
    return (valid & ~visual) | chosen_mask[:, :length]
