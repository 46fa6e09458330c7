"""The layout of a wrapped model's outputs: map the pruned sequence back to the input positions.

A prefill that prunes runs the layers after a stage on a shorter, re-padded sequence, so the language model's
last hidden state (and the logits computed from it) has one row per *kept* token, not one per input token.
Code written for transformers indexes logits by input position (``logits[b, mask[b].sum() - 1]``, the
per-token log-likelihood of a prompt, lmms-eval's loglikelihood requests), so by default
(``wrap(..., logits="input")``) the engine scatters the last hidden state back to the input layout before the
model's ``lm_head`` runs: text positions get their exact values (text is never pruned), pruned visual
positions get NaN (they have no logit) and padding positions get zeros (finite, meaningless, as in the
unwrapped model). ``logits="pruned"`` keeps the shorter layout; every pruned prefill's output also carries
``kept_positions`` (:func:`final_positions`), the input position of each row of that layout.

Pure tensor functions; the engine calls them from two thin hooks (:mod:`vtprune.engine`).
"""

from __future__ import annotations

from typing import Any

import torch

PAD_ROW = -1
IGNORE_INDEX = -100  # transformers' loss skips labels of this value
LABEL_KEYS = ("labels", "shift_labels")


def final_positions(index: torch.Tensor, valid: torch.Tensor, pre_llm_index: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Input position of every row of the pruned layout, ``-1`` on the padding rows the layout added.

    index: ``[B, L_kept]`` long, the position each slot of the last stage's view takes from the language
        model's input; valid: ``[B, L_kept]`` bool, False on padding slots; pre_llm_index: ``[B, L_0]`` long
        (optional), the input position of each slot of the LM input after a pre-LLM stage (then ``index``
        points into that shortened input).
    Returns ``[B, L_kept]`` long.
    """
    positions = index if pre_llm_index is None else torch.gather(pre_llm_index, 1, index)
    return torch.where(valid, positions, torch.full_like(positions, PAD_ROW))


def to_input_layout(rows: torch.Tensor, positions: torch.Tensor, visual: torch.Tensor,
                    pruned_fill: float = float("nan"), pad_fill: float = 0.0) -> torch.Tensor:
    """Scatter per-row values ``[B, R, D]`` to the input layout ``[B, L_in, D]``.

    positions: ``[B, R]`` long, the input position of each row (:func:`final_positions`), ``-1`` for rows
    to drop; visual: ``[B, L_in]`` bool, the visual positions of the input. An input position without a row
    is a pruned visual token (``pruned_fill``) or, as text is never pruned, padding (``pad_fill``).
    """
    batch, length = visual.shape
    out = torch.full((batch, length + 1, rows.shape[-1]), pad_fill, dtype=rows.dtype, device=rows.device)
    out[:, :length].masked_fill_(visual.to(rows.device)[..., None], pruned_fill)
    target = positions.to(rows.device)
    target = torch.where(target >= 0, target, torch.full_like(target, length))  # dropped rows: a spare column
    out.scatter_(1, target[..., None].expand(-1, -1, rows.shape[-1]), rows)
    return out[:, :length]


def to_pruned_layout(values: torch.Tensor, positions: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """The rows of input-layout ``values`` ``[B, L_in, ...]`` at ``positions`` ``[B, R]`` (``-1``: ``fill``).

    The inverse of :func:`to_input_layout` on the kept rows: ``to_pruned_layout(to_input_layout(x, p, v), p)``
    equals ``x`` wherever ``p >= 0``.
    """
    safe = positions.clamp(min=0).to(values.device)
    shape = (*safe.shape, *([1] * (values.dim() - 2)))
    gathered = torch.gather(values, 1, safe.view(shape).expand(*safe.shape, *values.shape[2:]))
    keep = (positions >= 0).to(values.device).view(shape)
    return torch.where(keep, gathered, torch.full_like(gathered, fill))


def set_output_rows(output: Any, hidden: torch.Tensor) -> Any:
    """Put ``hidden`` in ``output``'s ``last_hidden_state`` (a ``ModelOutput``, a dict or a tuple)."""
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    output["last_hidden_state"] = hidden
    return output


def last_hidden(output: Any) -> torch.Tensor | None:
    """The ``[B, L, D]`` last hidden state of a language model's output, or None."""
    if isinstance(output, tuple):
        return output[0] if output and isinstance(output[0], torch.Tensor) else None
    value = output.get("last_hidden_state") if hasattr(output, "get") else None
    return value if isinstance(value, torch.Tensor) else None


def attach_positions(output: Any, positions: torch.Tensor) -> None:
    """Set ``output.kept_positions`` on a ``ModelOutput`` (an attribute, not a field: ``to_tuple()`` and
    indexing are unchanged). Tuple outputs (``return_dict=False``) get nothing."""
    if hasattr(output, "to_tuple"):
        object.__setattr__(output, "kept_positions", positions)


def check_labels(layout: str, inputs: dict | None) -> None:
    """Refuse ``labels=`` on a pruned prefill whose logits come back in the pruned layout (rows and labels would
    not line up; transformers would raise a size mismatch, or pair them wrongly where the sizes happen to agree)."""
    if layout == "pruned" and inputs and inputs.get("labels") is not None:
        raise ValueError(
            "labels= needs logits in the input layout, but this model was wrapped with logits='pruned' (one row per "
            "kept token); wrap with logits='input' (the default), or compute the loss from output.logits mapped by "
            "output.kept_positions."
        )


def own_labels(inputs: dict) -> dict[str, torch.Tensor]:
    """Copies of the call's ``labels`` / ``shift_labels`` tensors, for :func:`ignore_unpredicted` to edit (the
    caller's tensors stay as they are); empty when the call has none."""
    return {key: inputs[key].clone() for key in LABEL_KEYS if isinstance(inputs.get(key), torch.Tensor)}


def ignore_unpredicted(labels: dict[str, torch.Tensor], positions: torch.Tensor, visual: torch.Tensor) -> None:
    """Set, in place, the labels that no logit row predicts to ``-100`` (ignored by the loss).

    A pruned visual token has no row (its logits are NaN in the input layout), so the token after it, such as
    the first text token after an image whose last visual token was pruned, has no prediction: its label would
    make the loss NaN. labels: ``{"labels": [B, L_in], "shift_labels": [B, L_in]}`` (either); positions:
    ``[B, R]`` long, the input position of each row (``-1``: none); visual: ``[B, L_in]`` bool.
    """
    batch, length = visual.shape
    has_row = torch.zeros(batch, length + 1, dtype=torch.bool, device=positions.device)
    target = torch.where(positions >= 0, positions, torch.full_like(positions, length))
    has_row.scatter_(1, target, True)
    unpredicting = visual.to(positions.device) & ~has_row[:, :length]  # rows that hold NaN
    for key, values in labels.items():
        if values.shape != visual.shape:
            continue  # transformers reports the mismatch itself
        rows = unpredicting.to(values.device)
        if key == "shift_labels":  # shift_labels[i] is predicted by row i
            values.masked_fill_(rows, IGNORE_INDEX)
        else:  # labels[i] is predicted by row i - 1
            values[:, 1:].masked_fill_(rows[:, :-1], IGNORE_INDEX)
