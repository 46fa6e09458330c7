"""GridProbe on Hugging Face VLMs: batched probes, the focused answer pass, and compute accounting.

GridProbe (arXiv:2605.10762); the math is in :mod:`vtprune.gridprobe`. Probes run on the selector model
(default: the answering model) without pruning, prefill only, last-position logits, at ``probe_pixels``
per frame; the answer pass runs on the selected frames at the processor's resolution, pruned by
``token_method`` (any vtprune method, optionally with per-frame budgets). Multiple-choice answers are the
argmax of the letter log-scores (no generation); open-ended answers are generated greedily.

Compute (GridProbe's accounting): LM prefill FLOPs of every pass from :mod:`vtprune.flops` (vision tower not
counted; logits of the last position only, as run here, where the reference counts all positions), with the
answer pass's pruning stages applied. The baseline is the monolithic unpruned pass over all ``K^2``
candidates at full resolution. Times are wall-clock model calls (vision tower included; decoding and
preprocessing excluded; generation included for open-ended answers).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from PIL import Image

from vtprune.adapters import get_adapter
from vtprune.api import wrap
from vtprune.config import PruneConfig, split_method_name
from vtprune.flops import LMShape, prefill_flops, tokens_per_layer
from vtprune.gridprobe.probe import (
    Selection,
    candidate_positions,
    effective_k,
    letter_log_scores,
    letter_posterior,
    letter_token_ids,
    parse_options,
    probe_confidence,
    question_letters,
    select_frames,
)
from vtprune.media.video import VideoClip, clip_from_frames, downscale, frame_inputs, video_route

PROBE_PIXELS = 224 * 224
ANSWER_SUFFIX = "Answer with the letter."


@dataclass
class GridProbeResult:
    """One answered question: the answer, the selected frames and what it cost (FLOPs: LM prefill)."""

    answer: str
    letter: str | None
    letter_probs: dict[str, float] | None
    mode: str
    route: str
    k: int
    m_eff: int
    frames_selected: list[int]
    times_selected: list[float]
    candidates: list[int]
    probe_flops: float
    answer_flops: float
    baseline_flops: float
    flops_ratio: float
    probe_ms: float
    answer_ms: float
    baseline_ms: float | None = None
    time_ratio: float | None = None
    probe_ensemble: str | None = None
    probe_visual_tokens: int = 0
    answer_visual_tokens: int = 0
    answer_kept_tokens: int = 0
    baseline_visual_tokens: int = 0
    selection: Selection | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PassOutput:
    """Last-position logits ``[P, V]`` of a batch of passes, token counts per pass, model time, pruning."""

    logits: torch.Tensor
    text_tokens: list[int]
    visual_tokens: list[int]
    ms: float
    stages: list[list[tuple[int, int]]]
    generated: list[str] | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lm_shape(model: Any) -> LMShape:
    return LMShape.from_config(model.config)


def pass_flops(shape: LMShape, text_tokens: int, visual_tokens: int, stages: list[tuple[int, int]] = ()) -> float:
    """LM prefill FLOPs of one pass; ``stages`` ``[(layer, visual kept)]`` from the pruning statistics."""
    return prefill_flops(shape, tokens_per_layer(shape, text_tokens, visual_tokens, stages), lm_head_tokens=1)


@torch.inference_mode()
def forward_pass(model: Any, processor: Any, frame_lists: list[list[Image.Image]], prompts: list[str],
                 route: str, batch: int | None = None, handle: Any = None, max_new_tokens: int = 0) -> PassOutput:
    """Prefill (or greedy generation when ``max_new_tokens``) of one frame list per prompt, in batches."""

    device = next(model.parameters()).device
    adapter, size = get_adapter(model), batch or len(frame_lists)
    logits, text, visual, stages, generated, total = [], [], [], [], [], 0.0
    for start in range(0, len(frame_lists), size):
        raw = frame_inputs(processor, model.config.model_type, frame_lists[start:start + size],
                           prompts[start:start + size], route)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in raw.items()}
        _sync(device)
        begin = time.perf_counter()
        if max_new_tokens:
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            new = output[:, inputs["input_ids"].shape[1]:]
            generated += [t.strip() for t in processor.batch_decode(new, skip_special_tokens=True)]
            logits.append(torch.zeros(len(new), 1))
        else:
            logits.append(model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1].float().cpu())
        _sync(device)
        total += (time.perf_counter() - begin) * 1000.0
        valid = inputs["attention_mask"].bool()
        marked = adapter.visual_mask(inputs["input_ids"]) & valid
        visual += marked.sum(dim=1).tolist()
        text += (valid.sum(dim=1) - marked.sum(dim=1)).tolist()
        stats = handle.last_stats if handle is not None else None
        for row in range(len(raw["input_ids"])):
            stages.append([(layer, kept[row]) for layer, kept in zip(stats.stage_layers, stats.kept, strict=True)] if stats else [])
    return PassOutput(torch.cat(logits), text, visual, total, stages, generated if max_new_tokens else None)


def question_prompt(question: str, options: list[str] | list[tuple[str, str]] | str | None
                    ) -> tuple[str, list[str], dict[str, str]]:
    """``(prompt, letters, option texts)``; letters are empty for an open-ended question."""
    if isinstance(options, str):
        options = parse_options(options)
    elif options is not None and options and isinstance(options[0], str):
        options = parse_options(";".join(options))
    if options:
        listed = " ".join(f"{letter}. {text}" for letter, text in options)
        return f"{question.strip()} {listed} {ANSWER_SUFFIX}", [letter for letter, _ in options], dict(options)
    letters = question_letters(question)
    return question.strip(), letters, {}


def _answer(model: Any, processor: Any, frames: list[Image.Image], prompt: str, letters: list[str], route: str,
            token_method: str | None, keep: float, frame_budget: str, wrap_options: dict | None,
            max_new_tokens: int) -> tuple[PassOutput, str, str | None, dict[str, float] | None]:
    """The focused pass (pruned by ``token_method``): ``(pass, answer, letter, letter probabilities)``."""

    handle = None
    if token_method is not None:
        handle = wrap_frames(model, token_method, keep, frame_budget, **dict(wrap_options or {}))
    try:
        if letters:
            out = forward_pass(model, processor, [frames], [prompt], route, handle=handle)
            probs = letter_posterior(out.logits, letter_token_ids(processor.tokenizer, letters))[0]
            letter = letters[int(probs.argmax())]
            return out, letter, letter, {lt: round(float(p), 6) for lt, p in zip(letters, probs.tolist(), strict=True)}
        out = forward_pass(model, processor, [frames], [prompt], route, handle=handle, max_new_tokens=max_new_tokens)
        return out, out.generated[0], None, None
    finally:
        if handle is not None:
            handle.remove()


def run_gridprobe(model: Any, processor: Any, video: VideoClip | list[Image.Image], question: str,
                  options: list[str] | str | None = None, *, k: int | None = 4,
                  selector: tuple[Any, Any] | None = None, token_method: str | None = None, keep: float = 1.0,
                  frame_budget: str = "global", wrap_options: dict | None = None,
                  probe_pixels: int | None = PROBE_PIXELS, probe_batch: int | None = None, s: float = 3.0,
                  m_min: int = 2, m_max: int | None = None, route: str = "auto", max_new_tokens: int = 8,
                  measure_baseline: bool = False) -> GridProbeResult:
    """Answer ``question`` about ``video`` from GridProbe-selected frames (GridProbe, arXiv:2605.10762).

    Parameters
    ----------
    video: a :class:`~vtprune.media.video.VideoClip` (from :func:`~vtprune.media.video.load_video`) or a list of frames.
    options: option texts (``["red", "blue"]``, ``"A) red;B) blue"``); None: letters listed in the question,
        else open-ended (confidence = peak first-token probability; the answer is generated).
    k: grid side (``K^2`` candidates, ``2K`` probes of ``K`` frames). Fewer than ``K^2`` frames shrink the grid
        to ``floor(sqrt(T))``; fewer than 4 frames skip probing (all frames answer). ``None``: no GridProbe.
    selector: ``(model, processor)`` that probes; default the answering model.
    token_method, keep, frame_budget, wrap_options: pruning of the answer pass. None leaves the model as it
        is (a handle the caller already holds then prunes the probes and the answer alike).
    probe_pixels: frame pixels in the probes (224x224 default, as in GridProbe); None: full resolution.
        Fixed-resolution towers (LLaVA) resize the frames back, so their probes cost the same tokens.
    probe_batch: probes per forward (default all 2K in one batch).
    s, m_min, m_max: Shape-Adaptive Selection (defaults 3, 2, K^2).
    route: ``auto`` / ``video`` / ``images`` (see :mod:`vtprune.media.video`).
    measure_baseline: also run the monolithic all-candidates pass to measure ``baseline_ms``.
    """
    clip = video if isinstance(video, VideoClip) else clip_from_frames(video)
    prompt, letters, texts = question_prompt(question, options)
    notes, mode = list(clip.notes), "multiple_choice" if letters else "open_ended"
    if not letters:
        notes.append("no options: open-ended question, probe confidence = peak first-token probability")
    answer_route = video_route(processor, route)
    k_eff = effective_k(len(clip), k) if k else 0
    if k and 2 <= k_eff < k:
        notes.append(f"{len(clip)} frames < K^2 = {k * k}: grid reduced to K = {k_eff}")
    selection, ensemble, probe_flops, probe_ms, probe_visual = None, None, 0.0, 0.0, 0
    if k_eff >= 2:
        candidates = candidate_positions(len(clip), k_eff)
        sel_model, sel_processor = selector or (model, processor)
        sel_route = video_route(sel_processor, route)
        small = [downscale(clip.frames[i], probe_pixels) for i in candidates]
        ids = letter_token_ids(sel_processor.tokenizer, letters) if letters else None
        record: dict[str, PassOutput] = {}

        def score(probes: list[list[int]]) -> list[float]:
            out = forward_pass(sel_model, sel_processor, [[small[c] for c in p] for p in probes],
                               [prompt] * len(probes), sel_route, probe_batch)
            record["out"] = out
            return probe_confidence(out.logits, ids).tolist()

        selection = select_frames(k_eff, score, s, m_min, m_max)
        out, shape = record["out"], lm_shape(sel_model)
        probe_flops = sum(pass_flops(shape, t, v) for t, v in zip(out.text_tokens, out.visual_tokens, strict=True))
        probe_ms, probe_visual = out.ms, out.visual_tokens[0]
        if ids is not None:
            mean = letter_log_scores(torch.log_softmax(out.logits, dim=-1), ids).mean(dim=0)
            ensemble = letters[int(mean.argmax())]
        positions = [candidates[c] for c in selection.cells]
    else:
        if k:
            notes.append(f"{len(clip)} frames < 4: too few for a 2x2 grid, no probing, answered with all frames")
        candidates = positions = list(range(len(clip)))
    answer_out, answer, letter, probs = _answer(
        model, processor, [clip.frames[i] for i in positions], prompt, letters, answer_route, token_method,
        keep, frame_budget, wrap_options, max_new_tokens)
    shape = lm_shape(model)
    answer_flops = pass_flops(shape, answer_out.text_tokens[0], answer_out.visual_tokens[0], answer_out.stages[0])
    kept = answer_out.stages[0][-1][1] if answer_out.stages[0] else answer_out.visual_tokens[0]
    baseline_frames = [[clip.frames[i] for i in candidates]]
    if measure_baseline:
        base = forward_pass(model, processor, baseline_frames, [prompt], answer_route)
        base_text, base_visual, baseline_ms = base.text_tokens[0], base.visual_tokens[0], base.ms
    else:
        base_text, base_visual, baseline_ms = _count_tokens(model, processor, baseline_frames, prompt, answer_route)
    baseline_flops = pass_flops(shape, base_text, base_visual)
    spent_ms = probe_ms + answer_out.ms
    if letter is not None and texts.get(letter):
        answer = f"{letter}. {texts[letter]}"
    return GridProbeResult(
        answer=answer, letter=letter, letter_probs=probs, mode=mode, route=answer_route,
        k=k_eff if selection is not None else 0,
        m_eff=len(positions), frames_selected=[clip.indices[i] for i in positions],
        times_selected=[round(clip.times[i], 4) for i in positions], candidates=[clip.indices[i] for i in candidates],
        probe_flops=probe_flops, answer_flops=answer_flops, baseline_flops=baseline_flops,
        flops_ratio=(probe_flops + answer_flops) / baseline_flops, probe_ms=probe_ms, answer_ms=answer_out.ms,
        baseline_ms=baseline_ms, time_ratio=spent_ms / baseline_ms if baseline_ms else None,
        probe_ensemble=ensemble, probe_visual_tokens=probe_visual, answer_visual_tokens=answer_out.visual_tokens[0],
        answer_kept_tokens=kept, baseline_visual_tokens=base_visual, selection=selection, notes=notes)


def _count_tokens(model: Any, processor: Any, frame_lists: list[list[Image.Image]], prompt: str,
                  route: str) -> tuple[int, int, None]:
    """Text and visual tokens of a pass, from the processor alone (no forward)."""

    inputs = frame_inputs(processor, model.config.model_type, frame_lists, [prompt], route)
    valid = inputs["attention_mask"].bool()
    visual = int((get_adapter(model).visual_mask(inputs["input_ids"]) & valid).sum())
    return int(valid.sum()) - visual, visual, None


FRAME_BUDGETS = ("global", "per_frame")
# PruneConfig fields among the wrap options (the rest are the method's own options)
CONFIG_FIELDS = ("schedule", "layer", "positions", "debias", "seed", "parity", "rounding", "logits")


def method_config(method: str, keep: float, frame_budget: str = "global", **options: Any) -> PruneConfig:
    """The :class:`PruneConfig` of ``method`` with ``frame_budget`` applied (``per_frame`` wraps it)."""
    if frame_budget not in FRAME_BUDGETS:
        raise ValueError(f"frame_budget must be one of {', '.join(FRAME_BUDGETS)}, got {frame_budget!r}.")
    fields = {k: options.pop(k) for k in CONFIG_FIELDS if k in options}
    if frame_budget == "global":
        return PruneConfig(method=method, keep=keep, options=options, **fields)
    base, debias = split_method_name(method)
    if base == "random":
        options.setdefault("seed", fields.get("seed", 0))
    return PruneConfig(method="per_frame" + ("+debias" if debias else ""), keep=keep,
                       options={"base": base, "base_options": options}, **fields)


def wrap_frames(model: Any, method: str = "fastv", keep: float = 0.25, frame_budget: str = "global",
                **options: Any):
    """:func:`vtprune.wrap` with a ``frame_budget`` option (``"global"`` or ``"per_frame"``)."""
    return wrap(model, method_config(method, keep, frame_budget, **options))
