"""The compacting layer-wise methods' hooks as registered ops, so that vLLM's compiled language model runs them.

torch.compile traces module hooks into the graph, freezing the Python control flow as it ran while tracing (a
warm-up step with no request). The hooks of :class:`vtprune.vllm.layerwise.runtime.LayerwiseRuntime` therefore call
these ops unconditionally, and each op decides at run time, in its runtime's Python, what the step needs (as
PrefixKV's two ops do, :mod:`vtprune.vllm.layerwise.ops`, whose lookup by attention layer name they share):

* ``vtprune::layer_begin`` (layer 0) reads the step's requests;
* ``vtprune::layer_input`` reads a layer's input: scores for a stage above it (FastV's layer ``K - 1``), or the
  method's captures before the layer;
* ``vtprune::layer_stage`` (a stage layer) returns the compacted ``(positions, hidden, residual)``: its row count is
  known only at run time, so its fake returns a new unbacked size (``torch.library.get_ctx().new_dynamic_size()``)
  and the compiled layers after it run for whatever count it returns;
* ``vtprune::layer_positions`` (layers above the first stage) returns the current layout's positions, as many as
  the layer's hidden rows (the language model passes every layer its own, uncompacted ``positions``);
* ``vtprune::layer_end`` (after the final norm) returns the rows at their scheduled places (again a new size);
* ``vtprune::layer_capture`` runs a method's capture of a module's output.

Each op is registered with :func:`vtprune.vllm.layerwise.ops.define_op` (one dispatcher call per call). An op
returns new tensors (an op's outputs may not alias its inputs): a copy of its input when the step
compacts nothing. Ops without outputs declare that they mutate their first tensor (they do not), so that the
compiler keeps them. Steps of decode rows only find nothing to do; a full CUDA graph that captured them replays the
copies without the Python.
"""

from __future__ import annotations

import torch

from vtprune.vllm.layerwise.ops import _runtime, define_op


def _copies(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


def _layer_begin_fake(hidden: torch.Tensor, layer_name: str) -> None:
    return None


@define_op(_layer_begin_fake, mutates_args=("hidden",))
def layer_begin(hidden: torch.Tensor, layer_name: str) -> None:
    """The step's first layer: the runtime reads the step's requests (``hidden`` ``[T, D]``: ``T`` the step's rows)."""
    target = _runtime(layer_name)
    if target is not None:
        target.begin(hidden.shape[0])


def _layer_input_fake(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                      layer_name: str, layer: int, use: str) -> None:
    return None


@define_op(_layer_input_fake, mutates_args=("hidden",))
def layer_input(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, layer_name: str,
                layer: int, use: str) -> None:
    """Decoder layer ``layer``'s input read, not changed: ``use="score"`` scores a stage above it for the prompts that
    end in this step, ``use="capture"`` runs the method's captures before it."""
    target = _runtime(layer_name)
    if target is not None:
        (target.score_ahead if use == "score" else target.layer_captures_at)(layer, positions, hidden, residual)


def _layer_stage_fake(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor, layer_name: str,
                      layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = torch.library.get_ctx().new_dynamic_size()
    return (positions.new_empty(*positions.shape[:-1], rows), hidden.new_empty(rows, hidden.shape[-1]),
            residual.new_empty(rows, residual.shape[-1]))


@define_op(_layer_stage_fake, mutates_args=())
def layer_stage(positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor, layer_name: str,
                layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions [..., T'], hidden [T', D], residual [T', D])`` after stage layer ``layer``'s compaction."""
    target = _runtime(layer_name)
    rows = target.stage_rows(layer, positions, hidden, residual) if target is not None else None
    return _copies(positions, hidden, residual) if rows is None else rows


def _layer_positions_fake(positions: torch.Tensor, hidden: torch.Tensor, layer_name: str,
                          layer: int) -> torch.Tensor:
    return positions.new_empty(*positions.shape[:-1], hidden.shape[0])


@define_op(_layer_positions_fake, mutates_args=())
def layer_positions(positions: torch.Tensor, hidden: torch.Tensor, layer_name: str, layer: int) -> torch.Tensor:
    """``[..., T']`` the positions of the rows ``hidden`` ``[T', D]`` holds at ``layer`` (after a stage's)."""
    target = _runtime(layer_name)
    current = target.current_positions() if target is not None else None
    return (positions if current is None else current).clone()


def _layer_end_fake(hidden: torch.Tensor, layer_name: str) -> torch.Tensor:
    return hidden.new_empty(torch.library.get_ctx().new_dynamic_size(), hidden.shape[-1])


@define_op(_layer_end_fake, mutates_args=())
def layer_end(hidden: torch.Tensor, layer_name: str) -> torch.Tensor:
    """``[T, D]`` the final norm's rows back at the step's scheduled places (pruned prompt rows zero)."""
    target = _runtime(layer_name)
    rows = target.end_rows(hidden) if target is not None else None
    return hidden.clone() if rows is None else rows


def _layer_capture_fake(output: torch.Tensor, inputs: list[torch.Tensor], layer_name: str,
                        capture: int) -> None:
    return None


@define_op(_layer_capture_fake, mutates_args=("output",))
def layer_capture(output: torch.Tensor, inputs: list[torch.Tensor], layer_name: str, capture: int) -> None:
    """Capture number ``capture`` of the method: a module's tensor ``inputs`` and its ``output``."""
    target = _runtime(layer_name)
    if target is not None:
        target.capture(capture, inputs, output)
