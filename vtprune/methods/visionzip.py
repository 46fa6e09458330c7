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
   mean of its group (:func:`vtprune.kernels.merge_tokens`), written in the target's slot. The released code
   writes ``target + sum(others) / count(others)`` instead (``context_value="release"``, what
   ``parity="release"`` sets; selections are the same, the contextual values differ).

``query="mean"`` ranks by the attention received from all queries on a CLIP tower too (for towers whose
CLS token the projector never used, e.g. one trained from scratch with the ``default`` feature strategy).
``queries`` (Qwen-VL towers): ``"auto"`` (default) averages every query on a GPU (the exact map) and, on a
CPU, up to :data:`~vtprune.methods.tower.FAST_PATCHES` (6,144) patches per image or frame, with 1,024 evenly
spaced queries above (a 9,216-patch image: about 9x less scoring time; how close it comes to the exact map
depends on the tower, ``docs/methods.md``), ``"all"`` always every query, an int that many queries. CLIP /
SigLIP crops (at most 729 patches) always use every query.
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
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext

PAPER_CONTEXTUAL = 10 / 64  # LLaVA-1.5 at 64 tokens: 54 dominant + 10 contextual (also 108+20, 162+30)
CONTEXT_VALUES = ("mean", "release")
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


def contextual_merge(hidden: torch.Tensor, keys: torch.Tensor, targets: int, value: str = "mean"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``r`` remainder tokens into ``targets`` contextual tokens (one image).

    hidden: ``[r, D]`` the remainder in token order; keys: ``[r, d]`` their keys. Returns the target indices
    ``[c]`` (into the remainder) and the merged tokens ``[c, D]``. Each non-target token joins the target whose
    key is most cosine-similar (ties: the earlier target); a target's value is (``value``) ``"mean"``: the
    plain mean of its group, itself included, or ``"release"``: :func:`release_context_value`.
    """
    index = evenly_spaced(hidden.shape[0], targets).to(hidden.device)
    normed = torch.nn.functional.normalize(keys.float(), dim=-1)
    assign = (normed @ normed[index].T).argmax(dim=-1)
    assign[index] = torch.arange(index.numel(), device=hidden.device)  # a target is its own group
    if value == "release":
        return index, release_context_value(hidden, assign, index)
    merged = merge_tokens(hidden[None], assign[None], torch.ones_like(assign, dtype=torch.float32)[None], index.numel(),
                          check=False)
    return index, merged[0]


def release_context_value(hidden: torch.Tensor, assign: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The released value of each contextual token ``[c, D]``: ``target + sum(others) / max(count(others), 1)``.

    hidden: ``[r, D]``; assign: ``[r]`` the target (``0..c-1``) each token joins; index: ``[c]`` the targets'
    rows. ``others`` are the group's tokens except the target, as the release's ``clip_encoder.py`` adds the
    mean of the merged tokens to the target (target 1.0, others [3.0, 5.0]: 1.0 + 4.0 = 5.0; the plain
    mean gives 3.0); fp32 sums, returned in ``hidden``'s dtype.
    """
    other = torch.ones(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    other[index] = 0.0
    sums = torch.zeros(index.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, assign, hidden.float() * other[:, None])
    counts = torch.zeros(index.numel(), dtype=torch.float32, device=hidden.device).index_add_(0, assign, other)
    return (hidden[index].float() + sums / counts.clamp(min=1.0)[:, None]).to(hidden.dtype)


@register_method
@dataclass(frozen=True)
class VisionZip(Scorer):
    """Dominant tokens by vision-tower attention + contextual merge of the rest, pre-LLM (VisionZip)."""

    name: ClassVar[str] = "visionzip"
    requires: ClassVar[frozenset[str]] = frozenset({"vit_attention"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="dvlab-research/VisionZip",
                                                 options=(("context_value", "release"), ("queries", "all")))
    contextual: float = PAPER_CONTEXTUAL
    vit_layer: int | None = None
    query: str = "auto"
    context_value: str = "mean"
    queries: str | int = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.contextual, bool) or not 0.0 <= float(self.contextual) < 1.0:
            raise ValueError(f"contextual={self.contextual!r} is the fraction of kept tokens that are merged "
                             f"contextual tokens; use a value in [0, 1) (paper: 10/64; 0 turns merging off).")
        if self.queries not in ("auto", "all") and (isinstance(self.queries, bool) or not isinstance(self.queries, int)
                                                    or self.queries < 1):
            raise ValueError(f"queries={self.queries!r}: use 'auto' (every query on a GPU; on a CPU every query up to "
                             f"{tower.FAST_PATCHES} patches per image, else {tower.FAST_ROWS} evenly spaced ones), "
                             "'all', or a number of queries >= 1.")
        if self.context_value not in CONTEXT_VALUES:
            raise ValueError(f"context_value={self.context_value!r}: use 'mean' (the group's plain mean) or 'release' "
                             "(the target plus the mean of the tokens merged into it, as the released code).")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        extra = (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()
        return (*tower.captures(adapter, KEY, self.vit_layer, self.name, self.query, self.queries), *extra)

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
                index, merged = contextual_merge(hidden[row, rest], rest_keys, n_ctx, self.context_value)
                hidden[row, rest[index]] = merged.to(hidden.dtype)
                kept[row, rest[index]] = True
        return kept, hidden

