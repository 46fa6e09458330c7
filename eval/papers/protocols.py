"""How each paper ran its numbers, as lmms-eval model arguments, and what still differs (per row, with its size).

* **PyramidDrop average budgets** (Xing et al., CVPR 2025, arXiv:2410.17247): the 192 / 128 / 64-token rows of
  the re-running papers count the visual tokens *averaged over the decoder layers*. vtprune's ``keep`` is the
  last stage's share, so a row with ``budget=average`` runs :func:`pdrop_average_schedule`: PyramidDrop's form
  (three drops at evenly spaced layers ``s, 2s, 3s``, each keeping ``lambda`` of the previous stage) with the
  spacing whose ``lambda`` is closest to the paper's 0.5 and ``lambda`` solved so that the mean visual tokens per
  layer equals the budget (within one token per layer after rounding).
* **FastV** rows name their layer (``layer=K``); **VisionZip** runs the exact vision-tower map (``queries=all``).
* The model's ``protocol`` (LLaVA-1.5: ``image_aspect_ratio=pad``) comes from :data:`~vtprune.eval.papers.data.MODELS`.
"""

from __future__ import annotations

from vtprune.eval.papers.data import MODELS, PaperRow, Setting, parse_options

from vtprune.config import Stage, keep_count

PDROP_LAMBDA = 0.5  # PyramidDrop's ratio between stages (layers 8/16/24 keeping 0.5/0.25/0.125 on LLaVA-1.5-7B)
TEXTVQA_OCR_GAP = "about 12 points on LLaVA-1.5 (EvolvingLMMs-Lab/lmms-eval#6 and #51)"


def average_visual_tokens(stages: tuple[Stage, ...], visual_tokens: int, layers: int) -> float:
    """Mean over the ``layers`` decoder layers of the visual tokens each layer sees (a stage at layer ``l`` prunes
    before 0-based layer ``l``; counts by :func:`vtprune.config.keep_count`, as vtprune keeps them)."""
    total = 0
    for layer in range(layers):
        active = [stage for stage in stages if stage.layer <= layer]
        total += keep_count(active[-1].keep, visual_tokens) if active else visual_tokens
    return total / layers


def _continuous_average(spacing: int, ratio: float, layers: int) -> float:
    """Average kept fraction of PyramidDrop stages at ``spacing, 2 spacing, 3 spacing`` keeping ``ratio ** i``."""
    return (spacing * (1 + ratio + ratio ** 2) + (layers - 3 * spacing) * ratio ** 3) / layers


def _solve_ratio(spacing: int, fraction: float, layers: int) -> float | None:
    """``ratio`` in (0, 1) with :func:`_continuous_average` equal to ``fraction`` (bisection), None if unreachable."""
    if not spacing / layers < fraction < 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if _continuous_average(spacing, middle, layers) < fraction else (low, middle)
    return (low + high) / 2


def pdrop_average_schedule(budget: float, visual_tokens: int, layers: int) -> tuple[Stage, ...]:
    """PyramidDrop stages whose mean visual tokens per decoder layer is ``budget * visual_tokens``.

    budget: the average kept fraction (``192 / 576``); visual_tokens: per image (576 on LLaVA-1.5); layers:
    decoder layers (32). Returns three :class:`~vtprune.config.Stage` at ``s, 2s, 3s`` keeping ``r, r^2, r^3``.
    Raises ``ValueError`` when no spacing reaches the budget (fewer than four layers, or a budget below
    ``visual_tokens / layers``).
    """
    candidates = []
    for spacing in range(1, (layers - 1) // 3 + 1):
        ratio = _solve_ratio(spacing, budget, layers)
        if ratio is not None:
            candidates.append((abs(ratio - PDROP_LAMBDA), spacing, ratio))
    if not candidates:
        raise ValueError(f"an average of {budget * visual_tokens:.1f} of {visual_tokens} visual tokens per layer cannot "
                         f"be reached by PyramidDrop's three stages on a {layers}-layer model.")
    _, spacing, ratio = min(candidates)
    return tuple(Stage(spacing * (i + 1), round(ratio ** (i + 1), 6)) for i in range(3))


def schedule_text(stages: tuple[Stage, ...]) -> str:
    """``5:0.49;10:0.2401;15:0.117649`` (``;`` separates stages inside lmms-eval's ``--model_args``)."""
    return ";".join(f"{stage.layer}:{stage.keep:g}" for stage in stages)


def method_args(setting: Setting, dry_run: bool) -> tuple[str, str]:
    """``(keep and method arguments, what the dry run changed)`` of a run, e.g. ``("keep=0.5,layer=3", "")``."""
    wanted = parse_options(setting.options)
    parts = [f"keep={setting.keep:g}"]
    changed = ""
    if "layer" in wanted:
        parts.append(f"layer={int(wanted['layer'])}")
    if wanted.get("budget") == "average":
        model = MODELS[setting.model]
        if dry_run:  # the embedded model (4 layers, 16 tokens) cannot reach most averages: the method's own schedule
            changed = "dry run: the method's own schedule at keep (average budget not applied)"
        else:
            stages = pdrop_average_schedule(setting.keep, model.visual_tokens, model.layers)
            parts = [f"keep={stages[-1].keep:g}", f"schedule={schedule_text(stages)}"]
    if setting.method == "visionzip":
        parts.append("queries=all")
    return ",".join(parts), changed


def protocol_note(row: PaperRow, mmbench: str) -> str:
    """The known protocol differences of ``row``'s measured number, each with its size ("" where none is known)."""
    notes: list[str] = []
    if row.keep is None:
        return "not run"
    if row.model.startswith("llava"):
        notes.append("llava-hf conversion through lmms-eval's prompts, batched, instead of the original LLaVA code "
                     "(size not measured: compare the unpruned rows)")
    if row.benchmark in ("TextVQA", "REL5") and row.model == "qwen2.5-vl-7b":
        notes.append("TextVQA without OCR tokens (lmms-eval's textvqa_val); whether the paper's Qwen2.5-VL run "
                     f"gave them is not stated here; they are worth {TEXTVQA_OCR_GAP}")
    elif row.benchmark == "TextVQA":
        notes.append("OCR tokens as LLaVA's prompt; lmms-eval capitalises the question (size not measured)")
    if row.benchmark in ("MMB", "REL5"):
        notes.append("MMBench scored by lmms-eval's regex rule, no GPT judge (unmatched answers count as wrong; "
                     "size not measured)" if mmbench == "static" else
                     "MMBench scored by lmms-eval's GPT judge; LLaVA's scripts submit to MMBench's own evaluation "
                     "(size not measured)")
    if "budget=average" in row.options:
        notes.append("average-budget schedule chosen by vtprune (the re-running papers publish no layer lists; "
                     "size unknown); the published re-runs disagree by up to 25 points, so the reference numbers are unstable")
    if row.method == "visionzip" and row.model.startswith("llava"):
        notes.append("VisionZip: CLS not among the dominant tokens and contextual tokens merged after the projector "
                     "(docs/methods.md; size not measured)")
    if row.paper.startswith("FastV") and "README" in row.source:
        notes.append("FastV's README ran lmms-eval's own LLaVA wrapper on the original weights; vtprune runs the "
                     "llava-hf conversion (size: compare the unpruned README rows)")
    if row.model == "qwen2.5-vl-7b":
        notes.append("image resolution bounds of the paper's Qwen2.5-VL runs not stated here; vtprune uses "
                     "min_pixels=200704, max_pixels=1605632 (size unknown)")
    return "; ".join(notes)
