"""M-RoPE positions of a pruned Qwen-VL prompt in vLLM: the kept tokens keep their original (t, h, w) positions.

vtprune's transformers path gathers the unpruned positions at the kept tokens, so text after an image continues
where it would without pruning. vLLM numbers a prompt with ``k`` placeholders per item; these two pure functions
give the same positions:

* :func:`prompt_positions` (at request start, before the tower runs): text positions exactly as unpruned
  (an item spans its original extent); every placeholder of an item gets the item's base position.
* :func:`fill_chunk` (after the tower, per scheduled chunk): adds the kept rows' (t, h, w) offsets to the
  placeholders of the chunk. It locates rows by runs of media tokens, not by ``<|vision_start|>``, so a chunk
  may end anywhere (vLLM's EVS helper fails on a chunk that ends right after ``<|vision_start|>``), and an
  item may span several runs (a Qwen3-VL video: one run per frame, a timestamp between).
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
    chunk, in prompt order (vLLM passes the slices of the items the chunk overlaps). The rows fill the
    placeholders at or after ``num_computed`` in order, run after run (an item may span several runs: a
    Qwen3-VL video has one per frame). A run's base is the position of the token before it, plus one.
    """
    out = positions.clone()
    rows = torch.cat([o.reshape(-1, 3) for o in offsets]) if len(offsets) else torch.zeros(0, 3, dtype=torch.long)
    filled = 0
    for start, end in media_runs(media):
        if filled == rows.shape[0]:
            break
        if end <= num_computed:
            continue
        begin = max(start, num_computed)
        take = min(end - begin, rows.shape[0] - filled)
        base = out[0, start - 1] + 1 if start > 0 else out.new_zeros(())
        out[:, begin:begin + take] = base + rows[filled:filled + take].T.to(out.device)
        filled += take
    if filled < rows.shape[0]:
        raise ValueError(f"vtprune: {rows.shape[0]} kept rows do not fit the prompt's placeholders after token "
                         f"{num_computed} ({filled} do).")
    return out
