"""MMTok (Dong et al., "MMTok: Multimodal Coverage Maximization for Efficient Inference of VLMs", ICLR 2026,
arXiv:2508.18264):
the visual tokens that best cover both the request's text tokens and the image's own tokens, before the LLM.

Per image (or frame), greedy maximum coverage (the release's ``mm_coverage_selection``): with ``x`` the visual
embeddings entering the language model ``[n, D]``, ``z`` the instruction's LM-input token embeddings ``[m, D]``
and ``v`` the vision tower's features of the same tokens ``[n, C]`` (all L2-normalised),

* ``P = softmax(z x^T / tau_tv, over the image's tokens) / m`` ``[m, n]``: how well each visual token covers each
  text token;
* ``Q = softmax(v v^T / tau_vv, over the image's tokens) / n`` ``[n, n]``: how well it covers each visual token;
* ``C = [P; alpha Q]``; each step picks ``argmax_j sum_i max(C_ij - best_i, 0)`` (ties: the earlier token) and
  raises ``best_i`` to ``max(best_i, C_ij)``. The image keeps its first ``keep_count(keep, n)`` picks.

Release defaults: ``alpha = 0.5``, ``tau_vv = 0.2``, ``tau_tv`` 0.02 on LLaVA and 0.01 on Qwen-VL
(``tv_temperature=None`` picks by family). ``v``: the projector's input on LLaVA families (CLIP / SigLIP
feature-layer patches, as the release's ``hidden_states[-2]``), the merger's input averaged over each 2x2 unit on
Qwen-VL (the release's ``img_features``); ``vision_space="lm"`` uses ``x`` instead. Text: the release embeds the
question's words with its stopwords removed (LLaVA) or ``"Question: " + question`` (Qwen); vtprune sees token
ids only and takes every token after the sample's last visual token (question and assistant prefix), each
sample its own. The release selects per LLaVA-NeXT crop and excludes LLaVA-1.5's pad-to-square patches
(transformers' processors centre-crop: none); vtprune selects per image (base view and tiles apart, as
:func:`vtprune.methods.lm_inputs.group_ids`). Attention-free; Qwen3-VL as ``divprune``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vtprune.config import Stage
from vtprune.methods import lm_inputs, tower
from vtprune.methods.base import Capture, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext

KEY = "mmtok"
TV_TEMPERATURE = {"llava": 0.02, "qwen": 0.01}  # the release's LLaVA and Qwen2.5-VL entry points
SPACES = ("tower", "lm")


# -- pure functions ----------------------------------------------------------------------------------------
def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` ``[n, D]`` over their L2 norm (at least 1e-8), fp32, as the release normalises."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-8)


def coverage_matrix(text: torch.Tensor, image: torch.Tensor, tower_features: torch.Tensor, alpha: float = 0.5,
                    tv_temperature: float = 0.02, vv_temperature: float = 0.2) -> torch.Tensor:
    """``[m + n, n]`` fp32 ``[P; alpha Q]`` of one image (module docstring); ``m = 0`` (no text) gives ``alpha Q``.

    text ``[m, D]``, image ``[n, D]`` (the LM-input space), tower_features ``[n, C]``.
    """
    x, v = unit_rows(image), unit_rows(tower_features)
    q = torch.softmax((v @ v.T) * (1.0 / vv_temperature), dim=1) / v.shape[0]
    if text.shape[0] == 0:
        return q * alpha
    p = torch.softmax((unit_rows(text) @ x.T) * (1.0 / tv_temperature), dim=1) / text.shape[0]
    return torch.cat([p, q * alpha], dim=0)


def greedy_coverage_order(coverage: torch.Tensor, steps: int) -> torch.Tensor:
    """The first ``min(steps, n)`` picks ``[k]`` of greedy maximum coverage of ``coverage`` ``[rows, n]``: each the
    column with the largest ``sum_i max(C_ij - best_i, 0)`` (ties: the earlier column), never twice."""
    rows, n = coverage.shape
    steps = min(int(steps), n)
    best = coverage.new_zeros(rows)
    mask = coverage.new_zeros(n)
    picks = torch.empty(steps, dtype=torch.long, device=coverage.device)
    for step in range(steps):
        gain = (coverage - best[:, None]).clamp_min(0).sum(dim=0) + mask
        pick = torch.argmax(gain)
        picks[step] = pick
        best = torch.maximum(best, coverage.index_select(1, pick.view(1))[:, 0])
        mask = mask.index_fill(0, pick.view(1), float("-inf"))
    return picks


def select(text: torch.Tensor, image: torch.Tensor, tower_features: torch.Tensor, count: int, alpha: float = 0.5,
           tv_temperature: float = 0.02, vv_temperature: float = 0.2) -> torch.Tensor:
    """Sorted indices ``[min(count, n)]`` MMTok keeps of one image (see :func:`coverage_matrix`)."""
    coverage = coverage_matrix(text, image, tower_features, alpha, tv_temperature, vv_temperature)
    return torch.sort(greedy_coverage_order(coverage, count)).values


# -- capture hooks: the tower-side features v, as records tower.token_maps aligns -----------------------------
def _grab_projector_input(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    features = args[0] if args else next(iter(kwargs.values()))
    features = features.detach().float()  # [crops, T, C]
    state.setdefault(KEY, []).append((features.new_zeros(features.shape[:2]), features))


def _grab_grid(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
    state[KEY + "_grid"] = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)


def _grab_merger_input(adapter: Any):
    unit = adapter.merge_size ** 2

    def grab(state: dict, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = (args[0] if args else next(iter(kwargs.values()))).detach().float()  # [S, C], the blocks' order
        grid = state.pop(KEY + "_grid", None)
        order = adapter.vit_merged_order(grid) if grid is not None else None
        state.setdefault(KEY, []).append(tower.merge_units(hidden.new_zeros(hidden.shape[0]), hidden, unit, order))

    return grab


# -- the scorer --------------------------------------------------------------------------------------------
@register_method
@dataclass(frozen=True)
class MMTok(Scorer):
    """Greedy coverage of the instruction's tokens and the image's own tokens per image, pre-LLM (MMTok)."""

    name: ClassVar[str] = "mmtok"
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="Ironieser/MMTok")
    alpha: float = 0.5
    tv_temperature: float | None = None
    vv_temperature: float = 0.2
    vision_space: str = "tower"

    def __post_init__(self) -> None:
        for field_name in ("alpha", "tv_temperature", "vv_temperature"):
            value = getattr(self, field_name)
            if field_name == "tv_temperature" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{field_name}={value!r}: use a number > 0 (release: alpha 0.5, tv_temperature "
                                 "0.02 on LLaVA / 0.01 on Qwen-VL, vv_temperature 0.2).")
        if self.vision_space not in SPACES:
            raise ValueError(f"vision_space={self.vision_space!r}: use 'tower' (the vision tower's features, as "
                             "released) or 'lm' (the LLM-input embeddings).")

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(0, keep),)

    def captures(self, adapter: Any, stages: tuple[Stage, ...]) -> tuple[Capture, ...]:
        extra = (lm_inputs.lm_input_capture(adapter),) if any(s.layer > 0 for s in stages) else ()
        if self.vision_space == "lm":
            return extra
        if tower.is_qwen(adapter):
            return (Capture(adapter.vision_tower, _grab_grid, before=True, outside_forward=True),
                    Capture(adapter.vision_tower.merger, _grab_merger_input(adapter), before=True,
                            outside_forward=True), *extra)
        return (Capture(adapter.backbone.multi_modal_projector, _grab_projector_input, before=True,
                        outside_forward=True), *extra)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        text, text_mask = lm_inputs.instruction_embeddings(ctx)  # before embedding_table consumes the capture
        embeddings = lm_inputs.input_embeddings(ctx)
        if self.vision_space == "tower":
            _, features = tower.token_maps(ctx, KEY, self.name)
            features = features.to(embeddings.device).gather(
                1, ctx.ordinal.clamp(min=0).to(embeddings.device)[..., None].expand(-1, -1, features.shape[-1]))
        else:
            features = embeddings
        alive = ctx.visual & ctx.valid
        family = "qwen" if tower.is_qwen(ctx.adapter) else "llava"
        tv = TV_TEMPERATURE[family] if self.tv_temperature is None else float(self.tv_temperature)

        def coverage_rank(row: int, groups: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
            """``-rank`` ``[L]`` of each slot in its image's greedy coverage order (unpicked slots last)."""
            words = text[row][text_mask[row]]
            rank = torch.full(groups.shape, groups.numel(), dtype=torch.long, device=groups.device)
            for group in groups[alive[row]].unique().tolist():
                slots = (alive[row] & (groups == group)).nonzero().flatten()
                image = embeddings[row, slots]
                coverage = coverage_matrix(words.to(image.device), image, features[row, slots], float(self.alpha),
                                           tv, float(self.vv_temperature))
                # a few picks beyond the quota settle the engine's rounding differences between images
                picks = greedy_coverage_order(coverage, int(quota[group]) + len(quota))
                rank[slots[picks.to(slots.device)]] = torch.arange(picks.numel(), device=rank.device)
            return -rank.float()

        return lm_inputs.per_image_scores(ctx, coverage_rank)
