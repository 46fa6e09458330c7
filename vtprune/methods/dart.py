"""DART (Wen et al., EMNLP 2025, arXiv:2502.11494): keep the visual tokens that duplicate the pivots least.

At the stage layer ``K`` (default 2, the paper's), with the keys ``k`` of layer ``K - 1`` (after RoPE, all
heads concatenated) and its output ``h`` (the input of layer ``K``) passed through the LM's final norm:

1. **Pivots**: the ``pivot_image`` visual tokens and the ``pivot_text`` text tokens after the last visual
   token with the largest key L1 norm ``||k_i||_1`` (defaults 4 + 4, the released configuration).
2. **Selection**: for each pivot in turn (image pivots, then text pivots, each by descending norm), keep
   its quota of the not-yet-kept visual tokens least cosine-similar to it (``argmin cos(h_p, h_i)``);
   image pivots are kept, text pivots only guide. The budget ``keep_count(keep, N)`` minus the image
   pivots is split evenly over the pivots (the first ones get the remainder), so exactly ``keep`` is kept.
   A ``pivot_image`` at or above the kept count makes every kept token a pivot (key norm alone); one above
   the sample's visual token count is surely a mistake, and a ``UserWarning`` says so at the call.

Attention-free (no attention map, so FlashAttention-friendly): one extra ``k_proj`` of layer ``K - 1``.
Per sample over all its visual tokens (the release concatenates the images of a sample too).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import schedules
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext

KEY = "dart_key_norm"


# -- pure functions ----------------------------------------------------------------------------------------
def pivot_quotas(budget: int, pivots: int) -> list[int]:
    """Tokens each of ``pivots`` pivots selects so that they share ``budget`` exactly (the first get the rest)."""
    if pivots <= 0:
        return []
    base, extra = divmod(max(budget, 0), pivots)
    return [base + (1 if i < extra else 0) for i in range(pivots)]


def duplication_order(hidden: torch.Tensor, pivots: torch.Tensor, candidates: torch.Tensor, quotas: list[int]
                      ) -> torch.Tensor:
    """The tokens DART selects, in order (one sample).

    hidden: ``[L, D]`` normalised states; pivots: ``[P]`` slots (in processing order); candidates: ``[C]`` slots
    that may be selected; quotas: per pivot. Each pivot takes its quota of the remaining candidates with the
    lowest cosine similarity to it (ties: the earlier candidate). Returns ``[sum(quotas)]`` slots (fewer if
    the candidates run out).
    """
    normed = torch.nn.functional.normalize(hidden.float(), dim=-1)
    remaining = candidates.clone()
    chosen = []
    for pivot, quota in zip(pivots.tolist(), quotas, strict=True):
        if quota <= 0 or remaining.numel() == 0:
            continue
        similarity = normed[remaining] @ normed[pivot]
        take = torch.sort(similarity, stable=True).indices[:quota]
        chosen.append(remaining[take])
        keep = torch.ones(remaining.numel(), dtype=torch.bool, device=remaining.device)
        keep[take] = False
        remaining = remaining[keep]
    return torch.cat(chosen) if chosen else candidates[:0]


def top_slots(values: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` slots of ``mask`` with the largest ``values`` ``[L]``, best first (ties: the earlier slot)."""
    index = mask.nonzero().flatten()
    order = torch.sort(-values[index].float(), stable=True).indices[:count]
    return index[order]


@register_method
@dataclass(frozen=True)
class DART(Scorer):
    """Duplication-aware: keep the tokens least similar to 4+4 key-norm pivots, at layer 2 (DART)."""

    name: ClassVar[str] = "dart"
    requires: ClassVar[frozenset[str]] = frozenset({"llm_layers"})
    pivot_image: int = 4
    pivot_text: int = 4

    def __post_init__(self) -> None:
        for option in ("pivot_image", "pivot_text"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{option}={value!r} must be an int >= 0 (the paper uses 4).")
        if self.pivot_image + self.pivot_text == 0:
            raise ValueError("pivot_image + pivot_text must be >= 1: DART selects tokens relative to pivots.")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return schedules.single_layer(num_layers, keep, layer=2)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        """Key L1 norms of layer ``K - 1`` for every in-LM stage at ``K``, from its input and RoPE."""
        return tuple(Capture(adapter.decoder_layers[s.layer - 1], _key_norms(adapter, s.layer - 1), before=True)
                     for s in stages if s.layer > 0)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        norms = ctx.state.get(KEY, {}).get(ctx.layer_index - 1)
        if norms is None or norms.shape != ctx.valid.shape:
            raise RuntimeError(f"dart found no keys of layer {ctx.layer_index - 1} in this layout "
                               "(another stage between the capture and the stage?).")
        norm = ctx.adapter.language_model.norm
        hidden = norm(ctx.hidden)
        norms = norms.to(hidden.device)
        alive = (ctx.visual & ctx.valid).to(hidden.device)
        text = _text_after_visual(ctx.valid.to(hidden.device), alive)
        out = torch.zeros(ctx.valid.shape, dtype=torch.float32, device=hidden.device)
        for row in range(out.shape[0]):
            alive_count = int(alive[row].sum())
            if alive_count == 0:
                continue
            budget = min(ctx.sample_kept_count(row), alive_count)
            if self.pivot_image > ctx.visual_counts[row]:
                pivot_note(self.pivot_image, budget, ctx.visual_counts[row])
            image_pivots = top_slots(norms[row], alive[row], min(self.pivot_image, budget))
            text_pivots = top_slots(norms[row], text[row], self.pivot_text)
            candidates = alive[row].clone()
            candidates[image_pivots] = False
            pivots = torch.cat([image_pivots, text_pivots])
            selected = duplication_order(hidden[row], pivots, candidates.nonzero().flatten(),
                                         pivot_quotas(budget - image_pivots.numel(), pivots.numel()))
            order = torch.cat([image_pivots, selected])
            out[row, order] = torch.arange(order.numel(), 0, -1, dtype=torch.float32, device=out.device)
        return out


def pivot_note(pivots: int, budget: int, visual: int) -> None:
    """Warn that ``pivot_image`` exceeds the sample's visual tokens: every kept token is then a key-norm pivot."""
    warnings.warn(f"dart: pivot_image={pivots} is more than the {visual} visual tokens of the sample, so all {budget} "
                  "kept tokens are image pivots chosen by key norm alone (no duplication step); use pivot_image "
                  "below the kept count (the paper: 4).", UserWarning, stacklevel=2)


def _text_after_visual(valid: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` valid non-visual slots after each sample's last visual slot (the question and prompt tail)."""
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(visual, positions, torch.full_like(positions, -1)).max(dim=1).values
    return valid & ~visual & (positions > last[:, None])


def _key_norms(adapter: Any, index: int):
    def save(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        embeddings = kwargs.get("position_embeddings")
        with torch.no_grad():
            query_index = torch.zeros(hidden.shape[0], 1, dtype=torch.long, device=hidden.device)
            _, key = adapter.project_qk(module, hidden, embeddings, query_index)  # [B, H_kv, L, d]
            state.setdefault(KEY, {})[index] = key.float().abs().sum(dim=(1, 3))

    return save
