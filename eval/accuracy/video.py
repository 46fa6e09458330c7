"""``vtprune bench --video``: frame selection x token pruning on the vtprune-shapes video split.

For every multiple-choice question of the first ``--clips`` clips, three frame selections answer:

* ``all``: the ``K^2`` GridProbe candidates (``round(linspace(0, T-1, K^2))``), the reference pass;
* ``uniform``: ``M`` frames sampled uniformly over the clip, ``M`` = the ``M_eff`` GridProbe chose;
* ``gridprobe``: GridProbe's selected frames (arXiv:2605.10762), its ``2K`` probes counted in the cost;

and each token method x keep prunes the answer pass. A method is a name (``fastv``: the global budget),
``NAME@per_frame`` (every frame keeps its own share) or ``temporal@NAME`` (temporal redundancy pre-LLM, then
``NAME`` per frame, :mod:`vtprune.methods.temporal`). One CSV row per model x selection x method x keep
with accuracy, evidence-frame recall, frames used, LM prefill FLOPs (probe + answer) and their ratio to the
unpruned all-frames pass, measured time and the run conditions; then a Markdown table and a PNG of accuracy
versus FLOPs ratio (``vtprune.eval.accuracy.video`` writes them; ``vtprune.eval.accuracy.bench`` dispatches here).
"""

from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from vtprune.eval.accuracy.defaults import DEFAULT_KEEPS as IMAGE_KEEPS
from vtprune.eval.accuracy.defaults import DEFAULT_METHODS as IMAGE_METHODS
from vtprune.eval.accuracy.report import dirty

DEFAULT_METHODS = "none,fastv,temporal"
DEFAULT_KEEPS = "1,0.25"
DEFAULT_OUT = "runs/bench_video"
SELECTIONS = ("all", "uniform", "gridprobe")
NEEDS_EVIDENCE = ("oracle",)
MAX_NEW_TOKENS = 4


@dataclass
class VideoQuestion:
    """One multiple-choice question about one clip; ``evidence`` are the frames that show the answer."""

    frames: list
    text: str
    answer: str
    qtype: str
    evidence: list[int]
    options: dict[str, str]


@dataclass
class Answer:
    """One answer pass: the letter (None: unparseable), whether it came from option text, cost and tokens."""

    letter: str | None
    mapped: bool
    flops: float
    ms: float
    visual: int
    kept: int


def question_options(text: str) -> dict[str, str]:
    """``{"A": "red", ...}`` from ``"... A. red B. blue ... Answer with the letter."``."""
    pattern = r"(?:^|\s)([A-J])\.\s+(.+?)(?=\s+[A-J]\.\s|\s+Answer with the letter\.|$)"
    return dict(re.findall(pattern, text.strip()))


def load_questions(split: str, clips: int, open_ended: bool = False) -> list[VideoQuestion]:
    """Every question of the first ``clips`` clips of the video split ``split``.

    ``open_ended``: ask without the options (``shapes_video.open_form``); answers are mapped to the options.
    """
    from vtprune.shapes.video import make_video_split, open_form

    return [VideoQuestion(s.frames, open_form(q)[0] if open_ended else q.text, q.answer, q.qtype, list(q.frames),
                          question_options(q.text))
            for s in make_video_split(split, clips) for q in s.questions]


def option_word_letter(logits: torch.Tensor, tokenizer: Any, options: dict[str, str]) -> str:
    """The letter of the option whose first token scores highest (open-ended questions, ``--answer score``)."""
    letters = list(options)
    ids = [tokenizer.encode(options[letter], add_special_tokens=False)[0] for letter in letters]
    return letters[int(logits[0, ids].argmax())]


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", " ", text.lower()).strip()


def answer_letter(text: str, options: dict[str, str]) -> tuple[str | None, bool]:
    """``(letter, mapped)`` of a generated answer: a leading option letter, else the option whose text it gives.

    ``mapped`` is True when the letter came from option text (``"red"`` -> the option reading ``red``): first
    an exact match of the whole answer, then the only option whose text appears in it as a word.
    """
    cleaned = text.strip()
    match = re.match(r"^\(?([A-J])(?:[.):,]|\s|$)", cleaned)
    if match and match.group(1) in options:
        return match.group(1), False
    answer = _norm(cleaned)
    exact = [letter for letter, option in options.items() if answer == _norm(option)]
    if exact:
        return exact[0], True
    words = set(answer.split())
    found = [letter for letter, option in options.items() if _norm(option) and _norm(option) in words]
    return (found[0], True) if len(found) == 1 else (None, False)


def context_limit(model: Any) -> int:
    """``max_position_embeddings`` of the language model."""
    text = getattr(model.config, "text_config", model.config)
    return int(getattr(text, "max_position_embeddings", 1 << 30))


def prompt_length(model: Any, processor: Any, frames: list, prompt: str, route: str) -> int:
    """Tokens of the prompt for ``frames`` + ``prompt`` (processor only, no forward)."""
    from vtprune.media.video import frame_inputs

    return int(frame_inputs(processor, model.config.model_type, [frames], [prompt], route)["input_ids"].shape[1])


def choose_k(model: Any, processor: Any, question: VideoQuestion, route: str, requested: int | None,
             extra: int) -> int:
    """``requested`` if its ``K^2``-frame prompt fits the context, else a clear error; None: largest K <= 4 that fits."""
    from vtprune.gridprobe import candidate_positions, effective_k
    from vtprune.gridprobe.run import question_prompt

    prompt, limit = question_prompt(question.text, None)[0], context_limit(model)
    for k in [requested] if requested else [4, 3, 2]:
        k_eff = effective_k(len(question.frames), k)
        frames = [question.frames[i] for i in candidate_positions(len(question.frames), k_eff)]
        length = prompt_length(model, processor, frames, prompt, route) + extra
        if length <= limit:
            return k
        one = prompt_length(model, processor, frames[:1], prompt, route)
        per_frame = (length - extra - one) / max(len(frames) - 1, 1)
        fit = int((limit - extra - one) // per_frame) + 1 if per_frame else len(frames)
    raise ValueError(
        f"the all-frames prompt of K^2 = {k_eff * k_eff} frames is {length} tokens (with {extra} generated) but "
        f"the model's max_position_embeddings is {limit}: at ~{per_frame:.0f} tokens per frame at most {fit} "
        f"frames fit; use a smaller --k (K^2 frames answer the all-frames pass).")


def method_spec(method: str) -> tuple[str, str, dict]:
    """``(method, frame_budget, options)`` of a benchmark method name: ``fastv``, ``fastv@per_frame`` (each frame
    its own share) or ``temporal@fastv`` (temporal pre-LLM, then FastV per frame)."""
    base, _, variant = method.partition("@")
    if not variant:
        return base, "global", {}
    if variant == "per_frame":
        return base, "per_frame", {}
    if base == "temporal":
        return base, "global", {"then": variant}
    raise ValueError(f"method {method!r}: use NAME, NAME@per_frame or temporal@NAME (e.g. temporal@fastv).")


def answer_pass(model: Any, processor: Any, frames: list, question: VideoQuestion, route: str, method: str,
                keep: float, mode: str) -> Answer:
    """One answer pass over ``frames`` pruned by ``method`` at ``keep``; letter from generation or letter scores."""
    from vtprune.gridprobe import letter_posterior, letter_token_ids
    from vtprune.gridprobe.run import forward_pass, lm_shape, pass_flops, question_prompt, wrap_frames

    prompt, letters, _ = question_prompt(question.text, None)
    name, frame_budget, options = method_spec(method)
    handle = None if method == "none" else wrap_frames(model, name, keep, frame_budget, **options)
    try:
        generate = MAX_NEW_TOKENS if mode == "generate" else 0
        out = forward_pass(model, processor, [frames], [prompt], route, handle=handle, max_new_tokens=generate)
    finally:
        if handle is not None:
            handle.remove()
    if mode == "generate":
        letter, mapped = answer_letter(out.generated[0], question.options)
    elif letters:
        probs = letter_posterior(out.logits, letter_token_ids(processor.tokenizer, letters))[0]
        letter, mapped = letters[int(probs.argmax())], False
    else:
        letter, mapped = option_word_letter(out.logits, processor.tokenizer, question.options), True
    stages = out.stages[0]
    flops = pass_flops(lm_shape(model), out.text_tokens[0], out.visual_tokens[0], stages)
    kept = stages[-1][1] if stages else out.visual_tokens[0]
    return Answer(letter, mapped, flops, out.ms, out.visual_tokens[0], kept)


def method_keeps(methods: list[str], keeps: list[float]) -> list[tuple[str, float]]:
    """Every method x keep; ``none`` only once (keep 1, it prunes nothing)."""
    pairs = [("none", 1.0)] if "none" in methods else []
    return pairs + [(m, k) for m in methods if m != "none" for k in keeps]


def evaluate_question(model: Any, processor: Any, question: VideoQuestion, k: int, pairs: list[tuple[str, float]],
                      args: argparse.Namespace) -> list[dict]:
    """GridProbe once, then every selection x method x keep; one record each."""
    from vtprune.gridprobe.run import run_gridprobe
    from vtprune.media.video import uniform_indices

    probe = run_gridprobe(model, processor, question.frames, question.text, k=k, probe_pixels=args.probe_pixels,
                          route=args.route)
    selections = {"all": probe.candidates, "uniform": uniform_indices(len(question.frames), probe.m_eff),
                  "gridprobe": probe.frames_selected}
    records = []
    for selection, positions in selections.items():
        frames = [question.frames[i] for i in positions]
        extra_flops, extra_ms = (probe.probe_flops, probe.probe_ms) if selection == "gridprobe" else (0.0, 0.0)
        for method, keep in pairs:
            ans = answer_pass(model, processor, frames, question, args.route, method, keep, args.answer)
            hits = len(set(positions) & set(question.evidence))
            records.append({
                "selection": selection, "method": method, "keep": keep, "qtype": question.qtype,
                "correct": float(ans.letter == question.answer), "mapped": float(ans.mapped),
                "unparsed": float(ans.letter is None), "recall": hits / len(question.evidence),
                "hit": float(hits > 0), "frames": len(positions), "m_eff": probe.m_eff,
                "probe_flops": extra_flops, "answer_flops": ans.flops, "baseline_flops": probe.baseline_flops,
                "ms": extra_ms + ans.ms, "visual": ans.visual, "kept": ans.kept})
    return records


def _means(records: list[dict]):
    """``key -> mean of records[i][key]``."""
    return lambda key: float(np.mean([r[key] for r in records]))


def summarise(records: list[dict]) -> list[dict]:
    """One row per selection x method x keep (in first-seen order): means, FLOP totals and ratio, time p50."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["selection"], r["method"], r["keep"]), []).append(r)
    rows = []
    for (selection, method, keep), rs in groups.items():
        mean = _means(rs)
        lm = sum(r["probe_flops"] + r["answer_flops"] for r in rs)
        rows.append({
            "selection": selection, "method": method, "keep": keep, "n": len(rs),
            "accuracy": round(mean("correct"), 4),
            **{f"accuracy_{q}": round(float(np.mean([r["correct"] for r in rs if r["qtype"] == q])), 4)
               for q in sorted({r["qtype"] for r in rs})},
            "answers_mapped": int(sum(r["mapped"] for r in rs)), "answers_unparsed": int(sum(r["unparsed"] for r in rs)),
            "evidence_recall": round(mean("recall"), 4), "evidence_hit": round(mean("hit"), 4),
            "mean_frames": round(mean("frames"), 3), "mean_m_eff": round(mean("m_eff"), 3),
            "mean_visual_tokens": round(mean("visual"), 1), "mean_kept_tokens": round(mean("kept"), 1),
            "probe_gflops": round(sum(r["probe_flops"] for r in rs) / len(rs) / 1e9, 6),
            "answer_gflops": round(sum(r["answer_flops"] for r in rs) / len(rs) / 1e9, 6),
            "lm_gflops": round(lm / len(rs) / 1e9, 6),
            "flops_ratio": round(lm / sum(r["baseline_flops"] for r in rs), 4),
            **{f"time_ms_p{p}": round(float(np.percentile([r["ms"] for r in rs], p)), 3) for p in (20, 50, 80)}})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table, then answer mapping and the run conditions."""
    lines = ["| selection | method | keep | accuracy | evidence recall | evidence hit | frames | FLOPs ratio "
             "| LM GFLOPs | time p50 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['selection']} | {r['method']} | {float(r['keep']):g} | {float(r['accuracy']):.3f} | "
                     f"{float(r['evidence_recall']):.3f} | {float(r['evidence_hit']):.3f} | "
                     f"{float(r['mean_frames']):.2f} | {float(r['flops_ratio']):.3f} | {float(r['lm_gflops']):.4g} | "
                     f"{float(r['time_ms_p50']):.1f} |")
    first = rows[0]
    mapped = sum(int(r["answers_mapped"]) for r in rows)
    unparsed = sum(int(r["answers_unparsed"]) for r in rows)
    lines += ["", f"{first['n']} questions ({first['clips']} clips of the {first['split']} split), K = {first['k']} "
              f"({int(first['k']) ** 2} candidate frames), answers by {first['answer_mode']}"
              f"{' to the open-ended question (options removed; GridProbe confidence = peak first-token probability)' if first.get('open_ended') else ''}; "
              f"{mapped} answers were option text mapped to their letter, {unparsed} matched no option (wrong). "
              "FLOPs: LM prefill, probes included for gridprobe, ratio to the unpruned all-frames pass.",
              "", f"Conditions: model {first['model']}, device {first['device']} ({first['threads']} thread{'' if str(first['threads']) == '1' else 's'}), "
              f"dtype {first['dtype']}, attention {first['attn_implementation']}, route {first['route']}, "
              f"batch 1 (probes: one batch of 2K), torch {first['torch']}, transformers {first['transformers']}, "
              f"vtprune {first['vtprune']} @ {first['git_sha']}{dirty(first)}, weights {first.get('weights_sha', '?')}, "
              f"{first['date']}."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> Path:
    """Accuracy versus FLOPs ratio: marker per selection, colour per method, keeps joined by a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    markers = dict(zip(SELECTIONS, ("o", "s", "^"), strict=True))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colours = {m: "black" if m == "none" else f"C{i}" for i, m in enumerate(methods)}
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for selection in SELECTIONS:
        for method in methods:
            points = sorted((float(r["flops_ratio"]), float(r["accuracy"])) for r in rows
                            if r["selection"] == selection and r["method"] == method)
            if points:  # unpruned: hollow and larger, so it shows under a method's keep=1 point
                hollow = {"markerfacecolor": "none", "markersize": 11} if method == "none" else {}
                ax.plot(*zip(*points, strict=True), marker=markers[selection], color=colours[method],
                        linestyle="-" if len(points) > 1 else "", label=f"{selection} / {method}", **hollow)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("LM FLOPs ratio (probe + answer) / all-frames pass")
    ax.set_ylabel("accuracy")
    ax.set_title(f"vtprune-shapes video, {rows[0]['model']}, K = {rows[0]['k']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def resolve_defaults(args: argparse.Namespace) -> tuple[list[str], list[float], Path]:
    """Methods, keeps and output folder; the image benchmark's defaults become the video ones."""
    from vtprune.methods import list_methods

    methods = [m for m in (DEFAULT_METHODS if args.methods == IMAGE_METHODS else args.methods).split(",") if m]
    keeps = [float(k) for k in (DEFAULT_KEEPS if args.keep == IMAGE_KEEPS else args.keep).split(",") if k]
    known = set(list_methods())
    for method in methods:
        name, _, options = method_spec(method)
        for part in (name, *options.values()):
            if part.split("+")[0] in NEEDS_EVIDENCE:
                raise ValueError(f"method {method!r} needs per-token evidence, which the video benchmark does not set.")
            if part.split("+")[0] not in known:
                raise ValueError(f"unknown method {part!r} in {method!r} (known: {', '.join(sorted(known))}).")
    if any(not 0 < k <= 1 for k in keeps):
        raise ValueError(f"keep must be in (0, 1], got {keeps}.")
    out = Path(DEFAULT_OUT if args.out == "runs/bench" else args.out)
    return methods, keeps, out


def run_video(args: argparse.Namespace) -> Path:
    """The whole video benchmark; returns the CSV path."""
    from vtprune.eval.accuracy.report import conditions

    from vtprune.media.video import video_route
    from vtprune.models.embedded import default_video_spec
    from vtprune.models.loading import load, model_label

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vtprune.cli.checks import check_output_dir
    from vtprune.cli.outputs import check_new_results

    methods, keeps, out = resolve_defaults(args)
    check_new_results(check_output_dir(out), ("bench_video.csv", "bench_video.md"), getattr(args, "force", False))
    args.model = args.model or default_video_spec()
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    questions = load_questions(args.split, args.clips, getattr(args, "open_ended", False))
    route = args.route = video_route(processor, args.route)
    extra = MAX_NEW_TOKENS if args.answer == "generate" else 0
    k = choose_k(model, processor, questions[0], route, args.k, extra)
    for question in questions[1:]:
        choose_k(model, processor, question, route, k, extra)
    pairs = method_keeps(methods, keeps)
    evaluate_question(model, processor, questions[0], k, [pairs[0]], args)  # warm-up, discarded
    records = []
    for question in tqdm(questions, desc="bench --video", unit="q"):
        records += evaluate_question(model, processor, question, k, pairs, args)
    env = {**conditions(model, args), "batch_size": 1}
    common = {"model": model_label(args.model), "split": args.split, "clips": args.clips, "k": k,
              "answer_mode": args.answer, "open_ended": bool(getattr(args, "open_ended", False)), "route": route, "probe_pixels": args.probe_pixels}
    rows = [{"model": common["model"], **r, **common, **env} for r in summarise(records)]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_video.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "bench_video.md").write_text(markdown_table(rows))
    plot(rows, out / "video_accuracy_vs_flops.png")
    print()
    print((out / "bench_video.md").read_text())
    print(f"[bench --video] wrote {path}, {out / 'bench_video.md'} and {out / 'video_accuracy_vs_flops.png'}")
    return path
