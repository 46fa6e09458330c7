"""How each paper ran its numbers, as lmms-eval model arguments, and what still differs (per row, with its size).

* **PyramidDrop average budgets** (Xing et al., CVPR 2025, arXiv:2410.17247): the 192 / 128 / 64-token rows of
  the re-running papers count the visual tokens *averaged over the decoder layers*. vtprune's ``keep`` is the
  last stage's share, so a row with ``budget=average`` runs :func:`pdrop_average_schedule`: PyramidDrop's form
  (three drops at evenly spaced layers ``s, 2s, 3s``, each keeping ``lambda`` of the previous stage) with the
  spacing whose ``lambda`` is closest to the paper's 0.5 and ``lambda`` solved so that the mean visual tokens per
  layer equals the budget (within one token per layer after rounding).
  Where that spacing puts the first drop in the first eighth of the decoder (the 128 and 64-token rows: layers
  2 and 1 of 32), the schedule drops about half the tokens where PyramidDrop keeps all of them (its first drop is
  at a quarter of the depth; its stage ablation finds 3 to 5 stages safe and warns that 32 stages, a drop right
  after layer 1, discards critical information), so those rows are labelled unable to test vtprune's ``pdrop``.
* **FastV** rows name their layer (``layer=K``); **VisionZip** runs the exact vision-tower map (``queries=all``).
* **Scoring per row**: ``ocr=yes|no`` picks TextVQA with or without LLaVA's reference OCR tokens (the LLaVA-NeXT
  rows differ), ``pope=pooled`` marks a POPE number scored by lmms-eval (its like-for-like counterpart is the
  table's *lmms-eval's way* column).
* The model's ``protocol`` (LLaVA-1.5: ``image_aspect_ratio=pad``) comes from :data:`~vtprune.eval.papers.data.MODELS`.
"""

from __future__ import annotations

from vtprune.eval.lmms_plugin.paper_tasks import TEXTVQA_OCR_TASK
from vtprune.eval.papers.data import MODELS, PaperRow, Setting, benchmark_task, parse_options, row_setting

from vtprune.config import Stage, keep_count

PDROP_LAMBDA = 0.5  # PyramidDrop's ratio between stages (layers 8/16/24 keeping 0.5/0.25/0.125 on LLaVA-1.5-7B)
TEXTVQA_OCR_GAP = "about 12 points on LLaVA-1.5 (EvolvingLMMs-Lab/lmms-eval#6 and #51)"
EARLY_FRACTION = 8  # a first drop before layers / 8 is against PyramidDrop's stage design (see the module docstring)


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
    for key in ("layer", "retain"):  # passed to the method as they are
        if key in wanted:
            parts.append(f"{key}={int(wanted[key])}")
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


def early_average_schedule(setting: Setting) -> bool:
    """Does ``setting`` run an average-budget PyramidDrop schedule whose first drop comes before ``layers / 8``
    (layers 2 and 1 of 32 at 128 and 64 tokens), against PyramidDrop's stage design?"""
    if parse_options(setting.options).get("budget") != "average":
        return False
    model = MODELS[setting.model]
    stages = pdrop_average_schedule(setting.keep, model.visual_tokens, model.layers)
    return stages[0].layer < model.layers / EARLY_FRACTION


def _textvqa_note(row: PaperRow) -> str:
    """Which TextVQA prompt the row's number is compared with."""
    if row.model == "qwen2.5-vl-7b":
        return ("TextVQA without OCR tokens (lmms-eval's textvqa_val); whether the paper's Qwen2.5-VL run gave them "
                f"is not stated here; they are worth {TEXTVQA_OCR_GAP}")
    if benchmark_task("TextVQA", row.model, options=row.options) == TEXTVQA_OCR_TASK:
        return "TextVQA with the reference OCR tokens, as the row's paper ran it (LLaVA's prompt)"
    return "TextVQA without OCR tokens, as the row's paper ran it (lmms-eval's textvqa_val)"


def _pope_note(row: PaperRow) -> str:
    """Which POPE scoring is like for like with the row's number."""
    pooled = parse_options(row.options).get("pope") == "pooled"
    if row.benchmark == "REL5":
        return ("the paper's POPE (inside REL5) is lmms-eval's pooled F1; the relative score here uses the per-split "
                "F1 (size not measured)") if pooled else ""
    if pooled:
        return ("POPE: the paper's number comes from an lmms-eval run (F1 pooled over the splits): the like-for-like "
                "number is the lmms-eval's way column, not measured")
    if row.model == "qwen2.5-vl-7b":
        return "POPE: the paper's scoring is not stated; measured is LLaVA's per-split F1 (lmms-eval's way beside it)"
    return "POPE: the paper's F1 per split (LLaVA's eval_pope.py): measured is like for like"


def protocol_note(row: PaperRow, mmbench: str) -> str:
    """The known protocol differences of ``row``'s measured number, each with its size ("" where none is known)."""
    notes: list[str] = []
    if row.keep is None:
        return "not run"
    if row.model.startswith("llava"):
        notes.append("llava-hf conversion through lmms-eval's prompts, batched, instead of the original LLaVA code "
                     "(size not measured: compare the unpruned rows)")
    if row.benchmark in ("TextVQA", "REL5"):
        notes.append(_textvqa_note(row))
    if row.benchmark in ("POPE", "REL5"):
        notes.append(_pope_note(row))
    if row.benchmark in ("MMB", "REL5"):
        notes.append("MMBench scored by lmms-eval's regex rule, no GPT judge (unmatched answers count as wrong; "
                     "size not measured)" if mmbench == "static" else
                     "MMBench scored by lmms-eval's GPT judge; LLaVA's scripts submit to MMBench's own evaluation "
                     "(size not measured)")
    if "budget=average" in row.options:
        notes.append("average-budget schedule chosen by vtprune (the re-running papers publish no layer lists; "
                     "size unknown); the published re-runs disagree by up to 25 points, so the reference numbers are unstable")
        if early_average_schedule(row_setting(row)):
            notes.append("cannot test vtprune's pdrop: this average budget needs a first drop of about half the tokens "
                         "before layer 4 of 32, where PyramidDrop's design keeps them all (its stage ablation: 3 to 5 "
                         "stages; 32 stages discard critical information)")
    if row.method == "visionzip" and row.model.startswith("llava"):
        notes.append("VisionZip: CLS not among the dominant tokens and contextual tokens merged after the projector "
                     "(docs/methods.md; size not measured)")
    if row.paper.startswith("FastV") and "README" in row.source:
        notes.append("FastV's README ran lmms-eval's own LLaVA wrapper on the original weights; vtprune runs the "
                     "llava-hf conversion (size: compare the unpruned README rows)")
    if row.model == "qwen2.5-vl-7b" and "MMTok" not in row.source:
        notes.append("image resolution bounds of the paper's Qwen2.5-VL runs not stated here; vtprune uses "
                     "min_pixels=200704, max_pixels=1605632 (size unknown)")
    return "; ".join(filter(None, notes))
