"""M-RoPE positions of a pruned Qwen-VL prompt in vLLM: the kept tokens keep their original (t, h, w) positions.

vtprune's transformers path gathers the unpruned positions at the kept tokens, so text after an image continues
where it would without pruning. vLLM numbers a prompt with ``k`` placeholders per item; these two pure functions
give the same positions:

* :func:`prompt_positions` (at request start, before the tower runs): text positions exactly as unpruned
  (an item spans its original extent); every placeholder of an item gets the item's base position.
* :func:`fill_chunk` (after the tower, per scheduled chunk): adds the kept rows' (t, h, w) offsets to the
  placeholders of the chunk. It locates rows by runs of media tokens, not by ``<|vision_start|>``, so a chunk
  may end anywhere (vLLM's EVS helper fails on a chunk that ends right after ``<|vision_start|>``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def prompt_positions(length: int, items: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """``([3, length] long, delta)`` for a prompt whose items are ``(offset, kept_rows, extent)`` (sorted).

    Text advances by one per token; an item's ``kept_rows`` placeholders all hold its base position ``p``
    (the position its first row would have), and the next text token gets ``p + extent``. ``delta`` is
    ``max + 1 - length`` (vLLM's ``mrope_position_delta``, used for decode positions).
    """
    positions = torch.empty(length, dtype=torch.long)
    cursor, nxt = 0, 0
    for offset, rows, extent in items:
        text = offset - cursor
        positions[cursor:offset] = torch.arange(text) + nxt
        nxt += text
        positions[offset:offset + rows] = nxt
        nxt += extent
        cursor = offset + rows
    positions[cursor:] = torch.arange(length - cursor) + nxt
    out = positions.expand(3, -1).clone()
    top = int(out.max()) + 1 if length else 0
    last = nxt + (length - cursor)
    return out, max(top, last) - length


def media_runs(media: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive ``True`` in a 1-D bool mask."""
    flags = media.long().tolist()
    runs, start = [], None
    for index, flag in enumerate(flags + [0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    return runs


def fill_chunk(positions: torch.Tensor, media: torch.Tensor, offsets: Sequence[torch.Tensor],
               num_computed: int) -> torch.Tensor:
    """Positions ``[3, N]`` with the chunk's kept rows at ``base + (t, h, w)`` (a new tensor).

    media: ``[N]`` bool, the prompt's placeholder tokens; offsets: ``[r_i, 3]`` long per item slice of this
    chunk, in prompt order (vLLM passes the slices of the items the chunk overlaps); the first slice starts at
    the first placeholder at or after ``num_computed``, each next one at the start of the next run. An item's
    base is the position of the token before its run, plus one.
    """
    out = positions.clone()
    runs = [(s, e) for s, e in media_runs(media) if e > num_computed]
    for index, (rows, (start, end)) in enumerate(zip(offsets, runs)):
        begin = max(start, num_computed) if index == 0 else start
        if begin + rows.shape[0] > end:
            raise ValueError(f"vtprune: {rows.shape[0]} kept rows do not fit the placeholder run {start}..{end}.")
        base = out[0, start - 1] + 1 if start > 0 else out.new_zeros(())
        out[:, begin:begin + rows.shape[0]] = base + rows.T.to(out.device)
    return out
