"""CDPruner (Zhang et al., "Beyond Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in
MLLMs", NeurIPS 2025, arXiv:2506.10967): the instruction-conditioned DPP subset of each image, before the LLM.

Per image (or frame), on the visual embeddings entering the language model ``x_i`` (``n`` of them):

1. **Similarity** ``S_ij = cos(x_i, x_j)``.
2. **Relevance** to the request's own instruction: ``r_i = mean_m cos(e_i, t_m)``, min-max normalised over the
   image's tokens as the release writes it, ``(r - min r + 1e-6) / (max r - min r)``.
3. **Conditional kernel** ``L_ij = q_i S_ij q_j`` with ``q = r`` (the release: its ``theta`` lines are commented
   out) or, with ``relevance_weight=theta`` in ``[0, 1)``, the paper's ``q = exp(alpha r)``,
   ``alpha = theta / (2 (1 - theta))`` (the release's commented rule, Chen et al.'s quality weighting).
4. **Fast greedy MAP** of the DPP (Chen et al., NeurIPS 2018): repeatedly the token with the largest remaining
   conditional gain ``d_j^2``, updated by Cholesky rows; the image keeps its first ``keep_count(keep, n)`` picks.
   When every gain is spent (``<= 1e-6`` of the largest diagonal: the kernel's rank is exhausted, possible when
   ``D < n``) the remaining tokens follow by relevance; the release would divide by ``sqrt`` of a spent gain.

Where ``e`` and ``t`` come from: with ``text_tower=PATH`` (a CLIP checkpoint, the one the model's CLIP tower was
taken from, e.g. ``openai/clip-vit-large-patch14-336`` for LLaVA-1.5 / NeXT), as the release does on LLaVA: ``e``
is CLIP's projected patch embedding (``visual_projection(post_layernorm(feature-layer patches))``), ``t`` its text
tower's embeddings of the instruction (read back as text with the model's tokenizer, cut into 77-token segments
as released), with ``-cos`` (CLIP's patch-text similarity is inverted on LLaVA). Without it (the default; no
model vtprune embeds has a paired text tower, nor does Qwen-VL): ``e = x`` and ``t`` is the mean LM-input
embedding of the instruction tokens with ``+cos``, as OpenVINO GenAI's port does for Qwen-VL (its text: every
non-visual prompt token; vtprune's: the text after the sample's last visual token, the engine's instruction
span). Each sample uses its own
instruction and each image its own normalisation: the release shares one question across a batch and
normalises over the whole batch, so a batch there differs from its samples alone (not here).
Attention-free; pre-LLM (stage at layer 0) on every family; a later stage (``schedule="2:0.25"``) reads the
captured LM input. The release selects per LLaVA-NeXT crop; vtprune per image (base view and tiles are
the groups of :func:`vtprune.methods.lm_inputs.group_ids`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext

CLIP_KEY = "cdpruner_clip"
SPENT = 1e-6  # a gain at or below this fraction of the largest diagonal is spent (the kernel's rank is exhausted)


# -- pure functions ----------------------------------------------------------------------------------------
def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``[n, D]`` divided by their L2 norm (fp32; a zero row stays zero)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def relevance(image: torch.Tensor, text: torch.Tensor, negate: bool = False) -> torch.Tensor:
    """Min-max normalised instruction relevance ``[n]`` (fp32) of one image's tokens.

    image ``[n, C]``, text ``[m, C]`` in the same space: ``r_i = mean_m cos(image_i, text_m)`` (``-cos`` with
    ``negate``, the release's CLIP rule), then ``(r - min + 1e-6) / (max - min)`` as the release normalises
    (over this image only). All equal (one token, no instruction): ones.
    """
    raw = (unit_rows(image) @ unit_rows(text).T).mean(dim=-1)
    raw = -raw if negate else raw
    low, span = raw.min(), raw.max() - raw.min()
    return torch.where(span > 0, (raw - low + 1e-6) / span.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(raw))


def conditional_kernel(features: torch.Tensor, quality: torch.Tensor, relevance_weight: float | None = None
                       ) -> torch.Tensor:
    """``[n, n]`` fp32 kernel ``q_i cos(x_i, x_j) q_j`` of features ``[n, D]`` and relevance ``[n]``.

    ``relevance_weight`` None: ``q = relevance`` (the release); ``theta`` in ``[0, 1)``: ``q = exp(alpha r)`` with
    ``alpha = theta / (2 (1 - theta))`` (the paper). Example: two orthogonal tokens with relevance 1 and 0.5 give
    ``diag(1, 0.25)``.
    """
    normed = unit_rows(features)
    similarity = normed @ normed.T
    q = quality.float()
    if relevance_weight is not None:
        q = torch.exp(relevance_weight / (2.0 * (1.0 - relevance_weight)) * q)
    return q[:, None] * similarity * q[None, :]


def dpp_greedy_order(kernel: torch.Tensor, steps: int, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``min(steps, n)`` picks ``[k]`` of the fast greedy MAP inference of a DPP with kernel ``[n, n]``.

    Each step takes ``argmax_j d_j^2`` (ties: the earlier token), appends its Cholesky row
    ``e = (L_j - c_j^T C) / sqrt(d_j^2)`` and lowers every gain by ``e^2`` (Chen et al., NeurIPS 2018; the
    release's loop). Spent gains (:data:`SPENT`): the rest by ``fallback`` ``[n]`` descending (default: token
    order). No host read per step.
    """
    n = kernel.shape[0]
    steps = min(int(steps), n)
    device = kernel.device
    if steps <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    kernel = kernel.float()
    gains = kernel.diagonal().clone()
    floor = gains.max().clamp_min(0) * SPENT
    order_key = (-torch.arange(n, device=device, dtype=torch.float32) if fallback is None else fallback.float())
    rows = kernel.new_zeros(steps, n)
    taken = torch.zeros(n, dtype=torch.bool, device=device)
    picks = torch.empty(steps, dtype=torch.long, device=device)
    for step in range(steps):
        best = torch.argmax(gains)
        live = gains[best] > floor
        pick = torch.where(live, best, torch.argmax(order_key.masked_fill(taken, float("-inf"))))
        prior = torch.einsum("t,tn->n", rows[:step, pick], rows[:step])
        update = (kernel[pick] - prior) / torch.sqrt(gains[pick].clamp_min(floor))
        rows[step] = torch.where(live, update, torch.zeros_like(update))
        gains = gains - torch.square(rows[step])
        taken[pick] = True
        gains = gains.masked_fill(taken, float("-inf"))
        picks[step] = pick
    return picks


def select(features: torch.Tensor, image: torch.Tensor, text: torch.Tensor, count: int, negate: bool = False,
           relevance_weight: float | None = None) -> torch.Tensor:
    """Sorted indices ``[min(count, n)]`` CDPruner keeps of one image: kernel from ``features`` ``[n, D]``,
    relevance of ``image`` ``[n, C]`` to ``text`` ``[m, C]`` (see :func:`relevance`)."""
    quality = relevance(image, text, negate)
    picks = dpp_greedy_order(conditional_kernel(features, quality, relevance_weight), count, quality)
    return torch.sort(picks).values


# -- the CLIP text tower (text_tower=PATH) ------------------------------------------------------------------
@dataclass(frozen=True)
class ClipText:
    """A CLIP checkpoint's text tower and visual projection (the release's relevance on LLaVA), the model's own
    tower's ``post_layernorm``, and the model's tokenizer, which reads each instruction back as text."""

    clip: Any
    tokenizer: Any
    reader: Any
    post_layernorm: Any

    def text_embeds(self, text: str) -> torch.Tensor:
        """``[M, P]`` fp32 projected text embeddings of ``text`` in segments of the tower's context, zero-padded
        (the release's ``CLIPVisionTower.forward``)."""
        context = int(self.clip.config.text_config.max_position_embeddings)
        inputs = self.tokenizer(text=[text], return_tensors="pt")
        length = inputs["input_ids"].shape[1]
        pad = context * ((length - 1) // context + 1) - length
        device = self.clip.text_projection.weight.device
        inputs = {k: torch.cat([v, v.new_zeros(1, pad)], dim=1).reshape(-1, context).to(device)
                  for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            pooled = self.clip.text_model(**inputs).pooler_output
            return self.clip.text_projection(pooled).float()

    def image_embeds(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., P]`` fp32 ``visual_projection(post_layernorm(features))`` of feature-layer patches ``[..., C]``."""
        with torch.no_grad():
            normed = self.post_layernorm(features)
            weight = self.clip.visual_projection.weight
            return self.clip.visual_projection(normed.to(weight.dtype)).float()


def load_clip_text(path: str, adapter: Any) -> ClipText:
    """The CLIP checkpoint at ``path`` for ``adapter``'s model; ValueError naming the fix when it cannot serve."""
    vision = getattr(adapter.config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if tower.is_qwen(adapter) or kind != "clip_vision_model":
        raise ValueError(f"cdpruner: text_tower={path!r} pairs with a CLIP vision tower; {adapter.config.model_type}'s "
                         f"tower is {kind or 'not CLIP'}: drop text_tower (relevance then comes from the LM's input "
                         "embeddings of the instruction).")
    reader_path = getattr(adapter.model, "name_or_path", "") or ""
    try:
        from transformers import AutoTokenizer, CLIPModel

        clip = CLIPModel.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        reader = AutoTokenizer.from_pretrained(reader_path) if reader_path else None
    except (OSError, ValueError) as error:
        raise ValueError(f"cdpruner: cannot load text_tower={path!r} (a CLIP checkpoint: folder or hub id) or the "
                         f"model's tokenizer from {reader_path!r}: {str(error).splitlines()[0]}") from error
    if reader is None:
        raise ValueError("cdpruner: text_tower reads each instruction back with the model's tokenizer, and this "
                         "model has no name_or_path to load it from; load the model from a folder or hub id.")
    if clip.visual_projection.in_features != vision.hidden_size:
        raise ValueError(f"cdpruner: text_tower={path!r} projects {clip.visual_projection.in_features}-d patches and "
                         f"the model's tower gives {vision.hidden_size}-d ones; give the CLIP checkpoint the model's "
                         "tower was taken from.")
    layer_norm = getattr(adapter.vision_tower, "vision_model", adapter.vision_tower).post_layernorm
    weight = next(layer_norm.parameters())
    clip = clip.to(device=weight.device, dtype=weight.dtype).eval()
    return ClipText(clip, tokenizer, reader, layer_norm)


def _grab_clip_embeds(clip: ClipText):
    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        features = args[0] if args else next(iter(kwargs.values()))  # the projector's input [crops, T, C]
        embeds = clip.image_embeds(features)
        state.setdefault(CLIP_KEY, []).append((embeds.new_zeros(embeds.shape[:2]), embeds))

    return grab


def instruction_texts(ctx: ScoreContext, reader: Any) -> list[str]:
    """Each sample's instruction (the text after its last visual token) read back as text, special tokens dropped."""
    index, mask = ctx.instruction_queries()
    ids = ctx.inputs["input_ids"].to(index.device)
    text = (ctx.valid & ~ctx.visual).to(index.device).gather(1, index) & mask
    rows = ids.gather(1, index)
    return [reader.decode(rows[b][text[b]].tolist(), skip_special_tokens=True).strip() for b in range(ids.shape[0])]


# -- the scorer --------------------------------------------------------------------------------------------
@register_method
@dataclass(frozen=True)
class CDPruner(Scorer):
    """Instruction-conditioned DPP (fast greedy MAP) over the LLM-input embeddings per image, pre-LLM (CDPruner)."""

    name: ClassVar[str] = "cdpruner"
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Theia-4869/CDPruner")
    relevance_weight: float | None = None
    text_tower: str | None = None

    def __post_init__(self) -> None:
        weight = self.relevance_weight
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0.0 <= float(weight) < 1.0 or math.isnan(float(weight))):
            raise ValueError(f"relevance_weight={weight!r}: use None (the release: kernel r_i S_ij r_j) or theta in "
                             "[0, 1) (the paper: r -> exp(theta / (2 (1 - theta)) r)).")
        if self.text_tower is not None and (not isinstance(self.text_tower, str) or not self.text_tower):
            raise ValueError(f"text_tower={self.text_tower!r}: give a CLIP checkpoint (folder or hub id), or None.")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        extra = (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()
        if self.text_tower is None:
            return extra
        clip = load_clip_text(self.text_tower, adapter)
        object.__setattr__(self, "_clip", clip)  # the loaded towers: this scorer's own, not a dataclass field
        return (Capture(adapter.backbone.multi_modal_projector, _grab_clip_embeds(clip), before=True,
                        outside_forward=True), *extra)

    def queries(self, ctx: ScoreContext) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
        """Per sample its text side ``[M, P]`` (None: no instruction), and the image side ``[B, L, P]`` (None: the
        LLM-input embeddings): the CLIP towers' with ``text_tower``, else the mean LM-input embedding."""
        if self.text_tower is None:
            text, mask = lm_inputs.instruction_embeddings(ctx)  # before embedding_table consumes the capture
            return [text[b][mask[b]].float().mean(dim=0, keepdim=True) if bool(mask[b].any()) else None
                    for b in range(text.shape[0])], None
        clip: ClipText = self.__dict__["_clip"]
        texts = instruction_texts(ctx, clip.reader)
        _, embeds = tower.token_maps(ctx, CLIP_KEY, self.name)
        index = ctx.ordinal.clamp(min=0).to(embeds.device)
        image = embeds.gather(1, index[..., None].expand(-1, -1, embeds.shape[-1]))
        return [clip.text_embeds(t) if t else None for t in texts], image

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        text, image = self.queries(ctx)
        embeddings = lm_inputs.input_embeddings(ctx)
        image = embeddings if image is None else image.to(embeddings.device)
        negate = self.text_tower is not None  # the release's CLIP rule; OpenVINO GenAI's on LM embeddings
        alive = ctx.visual & ctx.valid
        weight = None if self.relevance_weight is None else float(self.relevance_weight)

        def dpp_rank(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            """``-rank`` ``[L]`` of each slot in its image's greedy MAP order (unpicked slots last)."""
            query = text[row]
            rank = torch.full(groups.shape, groups.numel(), dtype=torch.long, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                features = embeddings[row, slots]
                quality = torch.ones(slots.numel(), device=features.device) if query is None else \
                    relevance(image[row, slots], query.to(features.device), negate)
                # a few picks beyond the quota settle the engine's rounding differences between images
                picks = dpp_greedy_order(conditional_kernel(features, quality, weight), int(quota[group]) + len(quota),
                                         quality)
                rank[slots[picks.to(slots.device)]] = torch.arange(picks.numel(), device=rank.device)
            return -rank.float()

        return lm_inputs.per_image_scores(ctx, dpp_rank)
