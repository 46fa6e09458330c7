"""VisionZip (Yang et al., CVPR 2025, arXiv:2412.04467): dominant tokens by vision-tower attention, plus
contextual tokens merged from the rest, before the language model.

1. **Dominant** tokens: the visual tokens that receive the most attention at a late vision layer (the CLS
   query's row on CLIP; the mean over all queries on SigLIP and Qwen-VL's ViT), :mod:`vtprune.methods.tower`.
   Each image (or frame) keeps its own share (``keep_count(keep, n_image)``), as VisionZip compresses
   image by image.
2. **Contextual** tokens (the :meth:`VisionZip.merge` step): of the ``k`` tokens an image keeps,
   ``c = round(contextual * k)`` are contextual (default ``10 / 64``: the paper's 54 + 10 at 64 tokens,
   108 + 20 at 128, 162 + 30 at 192). The ``c`` lowest-ranked kept tokens go back to the remainder, ``c``
   evenly spaced tokens of the remainder (``step = max(1, r // c)``, in token order) become targets, every
   other remainder token joins the target whose key is most cosine-similar, and each target becomes the plain
   mean of its group (:func:`vtprune.kernels.merge_tokens`), written in the target's slot.

``query="mean"`` ranks by the attention received from all queries on a CLIP tower too (for towers whose
CLS token the projector never used, e.g. one trained from scratch with the ``default`` feature strategy).
Runs pre-LLM (stage at layer 0) on the LLM-input embeddings; Qwen3-VL (DeepStack) prunes at layer ``n``.
``contextual=0`` keeps only dominant tokens (no merge). See ``docs/methods.md`` for where vtprune and the
authors' code differ (merge space, CLS, positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.kernels import merge_tokens
from vtprune.methods import lm_inputs, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.scoring import ScoreContext

PAPER_CONTEXTUAL = 10 / 64  # LLaVA-1.5 at 64 tokens: 54 dominant + 10 contextual (also 108+20, 162+30)
KEY = "visionzip"


# -- pure functions ----------------------------------------------------------------------------------------
def contextual_count(kept: int, fraction: float, pruned: int) -> int:
    """Contextual tokens among ``kept`` (``round(fraction * kept)``, half up); 0 when nothing is pruned."""
    if pruned <= 0 or kept <= 0:
        return 0
    return min(kept, int(fraction * kept + 0.5))


def evenly_spaced(count: int, targets: int) -> torch.Tensor:
    """Indices of ``targets`` evenly spaced items among ``count`` (VisionZip: ``arange(0, count, step)[:c]``)."""
    step = max(1, count // max(targets, 1))
    return torch.arange(0, count, step)[:targets]


def contextual_merge(hidden: torch.Tensor, keys: torch.Tensor, targets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` remainder tokens into ``targets`` contextual tokens (one image).

    hidden: ``[r, D]`` the remainder in token order; keys: ``[r, d]`` their keys. Returns the target indices
    ``[c]`` (into the remainder) and the merged tokens ``[c, D]``: each target's plain mean with the tokens
    whose key is most cosine-similar to it (ties: the earlier target).
    """
    index = evenly_spaced(hidden.shape[0], targets).to(hidden.device)
    normed = torch.nn.functional.normalize(keys.float(), dim=-1)
    assign = (normed @ normed[index].T).argmax(dim=-1)
    assign[index] = torch.arange(index.numel(), device=hidden.device)  # a target is its own group
    merged = merge_tokens(hidden[None], assign[None], torch.ones_like(assign, dtype=torch.float32)[None], index.numel(),
                          check=False)
    return index, merged[0]


@register_method
@dataclass(frozen=True)
class VisionZip(Scorer):
    """Dominant tokens by vision-tower attention + contextual merge of the rest, pre-LLM (VisionZip)."""

    name: ClassVar[str] = "visionzip"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    contextual: float = PAPER_CONTEXTUAL
    vit_layer: int | None = None
    query: str = "auto"

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.contextual) < 1.0:
            raise ValueError(f"contextual={self.contextual!r} is the fraction of kept tokens that are merged "
                             f"contextual tokens; use a value in [0, 1) (paper: 10/64; 0 turns merging off).")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        extra = (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()
        return (*tower.captures(adapter, KEY, self.vit_layer, self.name, self.query), *extra)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        values, _ = tower.token_maps(ctx, KEY, self.name)
        attention = values.gather(1, ctx.ordinal.clamp(min=0))
        return lm_inputs.per_image_scores(ctx, lambda row, groups, quota: attention[row])

    def merge(self, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contextual tokens: per image, demote the lowest kept tokens and merge the remainder into targets."""
        if self.contextual <= 0:
            return kept, hidden
        _, keys = tower.token_maps(ctx, KEY, self.name)
        alive = ctx.visual & ctx.valid
        kept, hidden = kept.clone(), hidden.clone()
        for row in range(kept.shape[0]):
            if ctx.visual_counts[row] == 0:
                continue
            groups = lm_inputs.group_ids(ctx, row)
            for group in groups[alive[row]].unique().tolist():
                members = alive[row] & (groups == group)
                chosen = members & kept[row]
                n_ctx = contextual_count(int(chosen.sum()), float(self.contextual), int((members & ~kept[row]).sum()))
                if n_ctx == 0:
                    continue
                slots = chosen.nonzero().flatten()
                demoted = slots[torch.sort(scores[row, slots].float(), stable=True).indices[:n_ctx]]
                kept[row, demoted] = False
                rest = (members & ~kept[row]).nonzero().flatten()
                rest_keys = keys[row, ctx.ordinal[row, rest]].to(hidden.device)
                index, merged = contextual_merge(hidden[row, rest], rest_keys, n_ctx)
                hidden[row, rest[index]] = merged.to(hidden.dtype)
                kept[row, rest[index]] = True
        return kept, hidden

