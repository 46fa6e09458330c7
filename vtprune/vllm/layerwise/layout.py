"""The token layout of one vLLM step in every layer region: which rows each request has there, its sequence length
and where its new KV entries go. Pure functions (no vLLM import), so the rules are tested without an engine.

A request of a step is one of (``P`` prompt tokens, ``c`` computed before the step, ``n`` scheduled now):

* ``plain``: nothing pruned (no visual tokens, keep 1.0): every region sees its ``n`` rows, as stock vLLM.
* ``defer``: a pruned prompt whose prefill does not end in this step (chunked prefill, an encoder-budget split):
  region 0 runs the chunk; the pruned regions see one placeholder row (KV index 0 of the request's blocks, which
  the final step overwrites; its output is discarded) and the chunk's rows are kept for the final step.
* ``final``: the step that ends a pruned prompt (``c < P <= c + n``; after a preemption ``c + n`` may run past
  ``P``, the generated tokens being recomputed): the pruned regions see the whole kept prompt, written from the
  start of their own blocks (``m = c + n - pruned`` rows, sequence length ``m``).
* ``decode``: later steps of a pruned request: ``n`` rows; sequence length and KV positions ``pruned`` lower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("plain", "defer", "final", "decode")


@dataclass(frozen=True)
class StepRequest:
    """One request of a step: ``start`` its first row in the step's scheduled layout, ``scheduled`` (``n``),
    ``computed`` (``c``), ``prompt`` (``P``) and ``pruned`` (tokens missing in each region, region 0 first)."""

    index: int
    start: int
    scheduled: int
    computed: int
    prompt: int
    pruned: tuple[int, ...]

    @property
    def kind(self) -> str:
        if not any(self.pruned):
            return "plain"
        end = self.computed + self.scheduled
        if end < self.prompt:
            return "defer"
        return "final" if self.computed < self.prompt else "decode"

    def rows(self, region: int) -> int:
        """Rows of the request in ``region`` this step."""
        kind = self.kind
        if region == 0 or kind in ("plain", "decode"):
            return self.scheduled
        if kind == "defer":
            return 1
        return self.computed + self.scheduled - self.pruned[region]

    def seq_len(self, region: int) -> int:
        """Tokens the request's attention sees in ``region`` after this step."""
        end = self.computed + self.scheduled
        kind = self.kind
        if region == 0 or kind == "plain":
            return end
        return 1 if kind == "defer" else end - self.pruned[region]

    def kv_positions(self, region: int) -> torch.Tensor:
        """``[rows(region)]`` long: the KV index (token slot within the request's blocks of the region's group)
        of each row written this step."""
        count = self.rows(region)
        first = self.seq_len(region) - count
        return torch.arange(first, first + count, dtype=torch.long)


@dataclass(frozen=True)
class RegionLayout:
    """The requests of a step that have rows in one region, in batch order, and what the region's attention
    metadata needs: ``indices`` (their rows in the runner's input batch), ``query_lens``, ``seq_lens`` and
    ``kv_positions`` (``[sum(query_lens)]``, each row's KV index within its request)."""

    indices: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    kv_positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def query_start_loc(self) -> torch.Tensor:
        """``[R + 1]`` int32 cumulative query lengths."""
        return torch.tensor([0, *torch.tensor(self.query_lens).cumsum(0).tolist()], dtype=torch.int32)


def region_layout(requests: list[StepRequest], region: int) -> RegionLayout:
    """The :class:`RegionLayout` of ``region`` (requests without rows there are left out)."""
    chosen = [r for r in requests if r.rows(region) > 0]
    positions = [r.kv_positions(region) for r in chosen]
    return RegionLayout(
        indices=[r.index for r in chosen],
        query_lens=[r.rows(region) for r in chosen],
        seq_lens=[r.seq_len(region) for r in chosen],
        kv_positions=torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long),
    )


def slot_mapping(block_table: torch.Tensor, block_size: int, layout: RegionLayout) -> torch.Tensor:
    """``[tokens]`` int64 KV-cache slots of a region's rows: ``block_table[row, p // B] * B + p % B`` for each row's
    KV index ``p`` (``block_table`` ``[num_reqs, max_blocks]``, the group's table in the runner's batch order)."""
    rows = torch.repeat_interleave(torch.tensor(layout.indices, dtype=torch.long),
                                   torch.tensor(layout.query_lens, dtype=torch.long))
    positions = layout.kv_positions.to(block_table.device)
    rows = rows.to(block_table.device)
    blocks = block_table[rows, positions // block_size].long()
    return blocks * block_size + positions % block_size
