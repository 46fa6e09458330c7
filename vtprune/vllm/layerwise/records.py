"""What the workers keep of each pruned request between steps, and what one step knows of its requests.

A :class:`RequestRecord` lives from a request's first step until it leaves the runner: its visual tokens, kept
counts per stage and, while a chunked prefill is under way, the rows of the earlier chunks that the final step needs
(the input of the first score and stage layers, with positions, and the scorer's per-chunk captures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vtprune.config import Stage
from vtprune.vllm.layerwise.layout import StepRequest
from vtprune.vllm.layerwise.plan import LayerPlan
from vtprune.vllm.layerwise.requests import request_keep, visual_positions
from vtprune.vllm.layerwise.scoring import RequestView, merge_states


@dataclass
class Chunk:
    """Rows of one earlier chunk of a prompt: ``score_input`` (the first score layer's input stream, when it lies
    below the first stage), ``hidden`` / ``residual`` (the first stage layer's input), ``positions`` and the
    scorer's ``captures`` of the chunk."""

    score_input: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    captures: dict = field(default_factory=dict)


@dataclass
class RequestRecord:
    """One request's pruning on this worker: ``visual`` (prompt positions of its visual tokens), ``stages`` and
    ``kept`` (its keep's stages and kept counts), ``pruned`` (tokens missing per region), ``input_ids``, the chunks
    stashed so far and, during the final step, its method ``state``, ``view`` and pending ``scores``."""

    visual: torch.Tensor
    stages: tuple[Stage, ...]
    kept: tuple[int, ...]
    pruned: tuple[int, ...]
    input_ids: torch.Tensor
    chunks: list[Chunk] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    view: RequestView | None = None
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: LayerPlan, features: list, prompt_ids: Any, default_keep: float,
               carried: float | None = None) -> RequestRecord:
        """The record of a request with ``features``; ``carried``: the keep its scheduler planned
        (:func:`vtprune.vllm.layerwise.requests.carried_keep`), which wins over stripped items."""
        visual = visual_positions(features)
        keep = request_keep(features, default_keep, carried)
        kept = plan.kept_counts(int(visual.numel()), keep) if visual.numel() else tuple(0 for _ in plan.stages)
        pruned = (0, *(int(visual.numel()) - k for k in kept))
        ids = torch.as_tensor(list(prompt_ids) if prompt_ids is not None else [], dtype=torch.long)
        return cls(visual, plan.stages_for(keep), kept, pruned, ids)

    @property
    def num_visual(self) -> int:
        return int(self.visual.numel())

    def reset(self) -> None:
        """Forget a prefill under way (the request starts again from token 0, e.g. after a preemption)."""
        self.chunks.clear()
        self.state, self.view, self.scores = {}, None, {}

    def chunk_captures(self, current: dict) -> dict:
        """The captures of every chunk so far and of the current one, merged along the token dimension."""
        states = [chunk.captures for chunk in self.chunks if chunk.captures] + ([current] if current else [])
        return merge_states(states) if states else {}

    def stacked(self, name: str, current: torch.Tensor | None) -> torch.Tensor | None:
        """Rows of the stashed chunks' ``name`` followed by ``current`` (positions: along the last dimension)."""
        parts = [getattr(chunk, name) for chunk in self.chunks] + [current]
        parts = [part for part in parts if part is not None]
        if not parts:
            return None
        return torch.cat(parts, dim=-1 if name == "positions" else 0)


@dataclass
class StepEntry:
    """A request of the current forward: its :class:`StepRequest`, its record (None when it prunes nothing), its
    rows in the current layout (``start``, ``rows``), whether the first stage has compacted them, the captures of
    its current chunk and (a chunk that does not end its prompt) the :class:`Chunk` being stashed."""

    step: StepRequest
    record: RequestRecord | None
    start: int
    rows: int
    compacted: bool = False
    captures: dict = field(default_factory=dict)
    chunk: Chunk | None = None

    @property
    def kind(self) -> str:
        return self.step.kind

    def prompt_rows(self) -> int:
        """How many of the request's current rows are prompt rows (a recomputed request also has generated ones)."""
        if self.compacted:
            return int(self.record.view.index.numel())
        return min(self.rows, max(0, self.step.prompt - self.step.computed))
