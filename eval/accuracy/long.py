"""Token pruning over long visual contexts: all frames of a clip, or 2-8 images in one prompt.

``vtprune bench long --setting video`` answers every open-ended question of the first
``--clips`` clips of the vtprune-shapes video split from **all** of the clip's frames (16-32 frames x 16
tokens = 256-512 visual tokens; ``--frames 48`` makes 48-frame clips), each token method pruning at every
keep; ``--setting multi`` asks about one of ``--images`` images in one prompt (``vtprune.shapes.multi``).

Methods: ``none`` (the unpruned reference, run once), any vtprune method (``fastv``: one global budget over
the whole prompt), ``NAME@per_frame`` (every frame / image keeps its own ``keep_count``), ``temporal`` and
``temporal@NAME`` (video: temporal redundancy pre-LLM, then NAME per frame), ``gridprobe`` and
``gridprobe+NAME`` (video: GridProbe's frames, K = ``--k``, then NAME prunes the answer pass; the probes are
counted in FLOPs and time). ``random`` and ``oracle`` (evidence tokens first) are the reference lines.
``+debias`` methods use ``--debias-file`` when given (a calibration fitted on these long prompts).

Per answer: exact match of the one-word answer, token-level evidence recall (``vtprune.eval.accuracy.long_items``),
LM prefill FLOPs (``vtprune.flops``; ratio to the unpruned all-frames pass) and the wall time of
``generate`` (4 tokens, batch 1, vision tower included). Records are appended to ``records.jsonl`` as each
question finishes (``--resume`` continues a stopped run made with the same options, which ``run.json`` records:
``vtprune.eval.accuracy.long_resume``); the summary CSV, Markdown and PNG are written by
``vtprune.eval.accuracy.long_report`` with the run conditions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from vtprune.eval.accuracy.long_items import (
    LongItem,
    evidence_tokens,
    frame_segments,
    recall_metrics,
    token_frames,
)
from vtprune.eval.accuracy.long_resume import (
    JOURNAL,
    check_resume,
    record_key,
    record_options,
    resumed_records,
    run_options,
)

MAX_NEW_TOKENS = 4
ROUTE = "images"
KEEPS = "0.5,0.25,0.1,0.05"
VIDEO_METHODS = ("none,random,oracle,fastv,fastv+debias,pdrop,transprune,ttv,dart,divprune,visionzip,vflowopt,"
                 "random@per_frame,oracle@per_frame,fastv@per_frame,pdrop@per_frame,temporal,temporal@fastv,"
                 "gridprobe,gridprobe+fastv,gridprobe+pdrop")
MULTI_METHODS = ("none,random,oracle,fastv,fastv+debias,pdrop,transprune,ttv,dart,divprune,visionzip,vflowopt,"
                 "random@per_frame,oracle@per_frame,fastv@per_frame,pdrop@per_frame")


def method_parts(spec: str) -> tuple[str, str, str, dict]:
    """``(kind, token method, frame budget, options)`` of a benchmark method name (see the module docstring)."""
    if spec == "none":
        return "none", "none", "global", {}
    if spec == "gridprobe" or spec.startswith("gridprobe+"):
        _, _, token = spec.partition("+")
        return "gridprobe", token or "none", "global", {}
    base, _, variant = spec.partition("@")
    if not variant:
        return "tokens", base, "global", {}
    if variant == "per_frame":
        return "tokens", base, "per_frame", {}
    if base == "temporal":
        return "tokens", "temporal", "global", {"then": variant}
    raise ValueError(f"method {spec!r}: use NAME, NAME@per_frame, temporal@NAME, gridprobe or gridprobe+NAME.")


def plan(methods: list[str], keeps: list[float]) -> list[tuple[str, float]]:
    """``(method, keep)`` runs: ``none`` and ``gridprobe`` once at keep 1, every other method at every keep."""
    once = [(m, 1.0) for m in methods if m in ("none", "gridprobe")]
    return once + [(m, k) for m in methods if m not in ("none", "gridprobe") for k in keeps]


def wrap_spec(model: Any, token: str, budget: str, options: dict, keep: float, debias_file: str | None):
    """A handle pruning with ``token`` at ``keep`` (None for ``none``)."""
    from vtprune.gridprobe.run import wrap_frames

    if token == "none":
        return None
    options = dict(options)
    if debias_file and token.endswith("+debias"):
        options["debias"] = debias_file
    return wrap_frames(model, token, keep, budget, **options)


class Runner:
    """Answer passes of one model over frame lists, with token evidence and cost."""

    def __init__(self, model: Any, processor: Any) -> None:
        from vtprune.adapters import get_adapter

        from vtprune.gridprobe.run import lm_shape

        self.model, self.processor = model, processor
        self.adapter, self.shape = get_adapter(model), lm_shape(model)

    def inputs(self, frames: list, question: str) -> tuple[dict, list, int, int]:
        """Processor outputs of one prompt, its segments (one per frame), visual and text token counts."""
        from vtprune.media.video import frame_inputs

        raw = frame_inputs(self.processor, self.model.config.model_type, [frames], [question], ROUTE)
        visual = int(self.adapter.visual_mask(raw["input_ids"]).sum())
        segments = frame_segments(self.adapter.segments(raw["input_ids"], raw)[0], len(frames))
        return raw, segments, visual, int(raw["input_ids"].shape[1]) - visual

    @torch.inference_mode()
    def answer(self, raw: dict, handle: Any, evidence: torch.Tensor) -> dict:
        """Greedy answer, time, kept ordinals (last stage; None when unpruned) and LM prefill FLOPs."""
        from vtprune.gridprobe.run import pass_flops

        if handle is not None:
            handle.set_evidence([evidence])
        start = time.perf_counter()
        output = self.model.generate(**raw, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        ms = (time.perf_counter() - start) * 1000.0
        text = self.processor.batch_decode(output[:, raw["input_ids"].shape[1]:], skip_special_tokens=True)[0]
        stats = handle.last_stats if handle is not None else None
        stages = [(layer, kept[0]) for layer, kept in zip(stats.stage_layers, stats.kept, strict=True)] if stats else []
        kept = stats.kept_indices[-1][0] if stats and stats.kept_indices else None
        visual = int(evidence.numel())
        text_tokens = int(raw["input_ids"].shape[1]) - visual
        return {"text": text.strip(), "ms": ms, "kept": kept, "stages": stages,
                "flops": pass_flops(self.shape, text_tokens, visual, stages)}


def normalise(text: str) -> str:
    return text.strip().lower().rstrip(".").replace(" ", "-")


def check_context(model: Any, runner: Runner, item: LongItem) -> None:
    """Refuse a prompt past ``max_position_embeddings`` (with the generated tokens), saying how many frames fit."""
    from vtprune.errors import UserError
    from vtprune.models.pipeline import context_limit

    limit = context_limit(model)
    _, _, visual, text = runner.inputs(item.frames, item.question)
    length = visual + text + MAX_NEW_TOKENS
    if limit is not None and length > limit:
        _, _, one_visual, one_text = runner.inputs(item.frames[:1], item.question)
        per_frame = (visual + text - one_visual - one_text) / max(len(item.frames) - 1, 1)
        fit = 1 + int((limit - MAX_NEW_TOKENS - one_visual - one_text) // per_frame)
        raise UserError(f"a prompt of {len(item.frames)} frames is {length} tokens with {MAX_NEW_TOKENS} generated, "
                        f"past the model's max_position_embeddings {limit}: at {per_frame:.0f} tokens per frame "
                        f"(image tokens and their delimiters) at most {fit} frames fit.")


def evaluate_item(runner: Runner, item: LongItem, pairs: list[tuple[str, float]], args: argparse.Namespace
                  ) -> list[dict]:
    """Every method x keep on one question; one record each."""
    from vtprune.gridprobe.run import pass_flops

    raw, segments, visual, text_tokens = runner.inputs(item.frames, item.question)
    evidence = evidence_tokens(item, segments, visual)
    frames_of = token_frames(segments, visual)
    baseline = pass_flops(runner.shape, text_tokens, visual, [])  # the unpruned all-frames pass
    probe = None
    records = []
    for spec, keep in pairs:
        kind, token, budget, options = method_parts(spec)
        if kind == "gridprobe":
            probe = probe or run_probe(runner, item, args.k)
            out, frames_used = gridprobe_answer(runner, item, probe, token, keep, segments, args.debias_file)
            out["flops"] += probe.probe_flops
            out["ms"] += probe.probe_ms
        else:
            handle = wrap_spec(runner.model, token, budget, options, keep, args.debias_file)
            try:
                out = runner.answer(raw, handle, evidence)
            finally:
                if handle is not None:
                    handle.remove()
            frames_used = len(item.frames)
        kept = out["kept"]
        records.append({
            "group": item.group, "method": spec, "budget": budget, "keep": keep, "qtype": item.qtype,
            "correct": float(normalise(out["text"]) == normalise(item.answer)), "answer": out["text"],
            **recall_metrics(evidence, kept, frames_of), "frames": frames_used, "visual": visual,
            "kept": len(kept) if kept is not None else visual, "flops": out["flops"], "baseline_flops": baseline,
            "ms": out["ms"]})
    return records


def run_probe(runner: Runner, item: LongItem, k: int):
    """GridProbe's frame selection for one question (open-ended probes, no pruning)."""
    from vtprune.gridprobe.run import run_gridprobe

    return run_gridprobe(runner.model, runner.processor, item.frames, item.question, k=k, route=ROUTE,
                         max_new_tokens=MAX_NEW_TOKENS)


def gridprobe_answer(runner: Runner, item: LongItem, probe: Any, token: str, keep: float, segments: list,
                     debias_file: str | None) -> tuple[dict, int]:
    """The answer pass over GridProbe's frames, pruned by ``token``; kept ordinals mapped to all frames."""
    positions = list(probe.frames_selected)
    frames = [item.frames[i] for i in positions]
    raw, local, visual, _ = runner.inputs(frames, item.question)
    handle = wrap_spec(runner.model, token, "global", {}, keep, debias_file)
    try:
        out = runner.answer(raw, handle, torch.zeros(visual))
    finally:
        if handle is not None:
            handle.remove()
    kept_local = out["kept"] if out["kept"] is not None else list(range(visual))
    frame_of = token_frames(local, visual)
    out["kept"] = [segments[positions[int(frame_of[o])]].start + o - local[int(frame_of[o])].start for o in kept_local]
    return out, len(frames)


def load_items(args: argparse.Namespace) -> list[LongItem]:
    """The questions of the run: every ``--frames`` clip length, or every ``--images`` count."""
    from vtprune.eval.accuracy.long_items import multi_items, video_items

    if args.setting == "video":
        return [item for frames in args.frames for item in video_items(args.split, args.clips, frames or None)]
    return [item for n in args.images for item in multi_items(args.split, args.sets, n)]


def run(args: argparse.Namespace) -> Path:
    """The whole benchmark; appends to ``records.jsonl``, then writes the report. Returns the CSV path."""
    from vtprune.eval.accuracy.long_report import write_report
    from vtprune.eval.accuracy.report import conditions

    from vtprune.models.loading import load, model_label

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, processor = load(args.model, args.attn, "float32", "cpu")
    runner = Runner(model, processor)
    items = load_items(args)
    for group in dict.fromkeys(i.group for i in items):
        check_context(model, runner, max((i for i in items if i.group == group), key=lambda i: len(i.frames)))
    pairs = plan(args.methods, args.keep)
    journal = out / JOURNAL
    done = set()
    if args.resume and journal.exists():
        check_resume(out, run_options(args))  # checked before loading too; the folder may have changed since
        done = resumed_records(journal)
    elif journal.exists():
        journal.unlink()
    record_options(out, run_options(args))
    evaluate_item(runner, items[0], pairs[:2], args)  # warm-up, discarded
    with journal.open("a") as f:
        for index, item in enumerate(tqdm(items, desc=f"bench_long {args.setting}", unit="q")):
            left = [(m, k) for m, k in pairs if record_key(index, item.question, m, k) not in done]
            if not left:
                continue
            for record in evaluate_item(runner, item, left, args):
                f.write(json.dumps({"item": index, "question": item.question, **record}) + "\n")
            f.flush()
    env = {**conditions(model, args), "batch_size": 1}
    meta = {"model": model_label(args.model), "setting": args.setting, "split": args.split, "route": ROUTE,
            "k": args.k if args.setting == "video" else "", "debias_file": args.debias_file or "", **env}
    return write_report(journal, out, meta)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's arguments; a bad value is one ``error:`` line and exit status 2, before any model is loaded."""
    from vtprune.cli.checks import ATTN_IMPLEMENTATIONS, OneLineParser, int_range, name_list
    from vtprune.media.video_io import MAX_FRAMES
    from vtprune.shapes.task import SPLIT_SEEDS

    parser = OneLineParser(prog="vtprune bench long", description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=("video", "multi"), default="video")
    parser.add_argument("--model", default=None, help="default: embedded:qwen2_vl (video), embedded:llava (multi)")
    parser.add_argument("--methods", type=name_list, default=None,
                        help="comma-separated; default: every method of the setting")
    parser.add_argument("--keep", type=keep_list_below_one, default=KEEPS,
                        help="comma-separated keep fractions in (0, 1)")
    parser.add_argument("--split", choices=sorted(SPLIT_SEEDS), default="test")
    parser.add_argument("--clips", type=int_range(1), default=40, help="video: clips (two questions each)")
    parser.add_argument("--frames", type=int_list(0, MAX_FRAMES), default="0",
                        help=f"video: clip lengths, comma-separated, each 0..{MAX_FRAMES} (0: the split's 16-32)")
    parser.add_argument("--images", type=int_list(1, MAX_IMAGES), default="2,4,8",
                        help=f"multi: images per prompt, comma-separated, each 1..{MAX_IMAGES}")
    parser.add_argument("--sets", type=int_range(1), default=30, help="multi: image sets per count (three questions each)")
    parser.add_argument("--k", type=int_range(1, MAX_GRID), default=4, help=f"video: GridProbe grid side, 1..{MAX_GRID}")
    parser.add_argument("--debias-file", default=None, help="calibration JSON for the +debias methods")
    parser.add_argument("--attn", choices=ATTN_IMPLEMENTATIONS, default="sdpa")
    parser.add_argument("--threads", type=int_range(1), default=1)
    parser.add_argument("--resume", action="store_true", help="continue the records.jsonl of --out")
    parser.add_argument("--out", required=True, help="output folder (records.jsonl, the summary CSV, Markdown, PNG)")
    parser.add_argument("--force", action="store_true",
                        help="start again over the records.jsonl an earlier run left in --out (default: refuse)")
    args = parser.parse_args(argv)
    args.model = args.model or ("embedded:qwen2_vl" if args.setting == "video" else "embedded:llava")
    args.methods = (args.methods or (VIDEO_METHODS if args.setting == "video" else MULTI_METHODS)).split(",")
    for spec in args.methods:
        try:
            kind, token, _, options = method_parts(spec)
            check_method(kind, token, options, args.setting)
        except ValueError as error:
            parser.error(f"argument --methods: {error}")
    from vtprune.cli.checks import check_output_dir
    from vtprune.cli.outputs import check_new_results
    from vtprune.methods.debias import check_debias_option

    try:
        check_output_dir(args.out)
        if args.resume and args.force:
            raise ValueError("give --resume (continue the run in --out) or --force (start again over it), not both")
        if args.resume:
            check_resume(args.out, run_options(args))
        else:
            check_new_results(args.out, (JOURNAL,), args.force, resume=True)
        if args.debias_file is not None:
            check_debias_option(args.debias_file)
    except ValueError as error:
        parser.error(str(error))
    return args


MAX_IMAGES = 16  # images per prompt in --setting multi (8 x 256 tokens already fill a 2k context)
MAX_GRID = 16  # GridProbe's K: K * K <= 256 frames


def keep_list_below_one(text: str) -> list[float]:
    """argparse type: comma-separated keep fractions, each in ``(0, 1)`` (the unpruned row runs once anyway)."""
    from vtprune.cli.checks import keep_list

    values = [float(item) for item in keep_list(text).split(",")]
    if any(value >= 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"keep fractions must be below 1 (the 'none' row is the unpruned run), "
                                         f"got {text!r}")
    return values


def int_list(low: int, high: int):
    """argparse type factory: comma-separated integers, each in ``[low, high]``."""
    from vtprune.cli.checks import int_range

    def parse(text: str) -> list[int]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers such as '2,4', got {text!r}")
        from vtprune.cli.checks import refuse_repeats

        values = [int_range(low, high)(item) for item in items]
        refuse_repeats(values, items, text)
        return values

    parse.__name__ = "integer list"
    return parse


def check_method(kind: str, token: str, options: dict, setting: str) -> None:
    """ValueError (one line) for a benchmark method the setting cannot run or vtprune does not know."""
    from vtprune.methods import resolve

    if kind == "gridprobe" and setting != "video":
        raise ValueError("gridprobe selects video frames: use it with --setting video")
    for name in (token, options.get("then")):
        if name and name != "none":
            resolve(name)


def main(argv: list[str] | None = None) -> int:
    """Run; bad input (e.g. clips longer than the model's context) is one ``error:`` line and exit status 2."""
    from vtprune.cli import run_reporting_errors

    args = parse_args(argv)

    def command() -> int:
        run(args)
        return 0

    return run_reporting_errors(command, "bench_long")


if __name__ == "__main__":
    raise SystemExit(main())
