"""``vtprune run --video PATH --question TEXT [--frames N] [--gridprobe K] [--options ...]``.

Without ``--gridprobe`` the ``N`` uniformly sampled frames (default 8) answer directly; with ``--gridprobe K``
the video is sampled at ``N = K^2`` frames (or ``--frames``), GridProbe (arXiv:2605.10762) selects ``M_eff`` of
the ``K^2`` candidates, and one pruned pass answers. Imported by ``vtprune.cli`` without importing torch.
"""

from __future__ import annotations

import argparse
import json

from vtprune.cli.checks import int_range
from vtprune.errors import UserError

MAX_FRAMES = 256  # vtprune.media.video_io.MAX_FRAMES (not imported: no PIL / numpy at CLI import)
MAX_GRID = 16  # K^2 <= MAX_FRAMES
MIN_PROBE_PIXELS, MAX_PROBE_PIXELS = 28 * 28, 1024 * 1024


def add_video_arguments(parser: argparse.ArgumentParser) -> None:
    """The video options of ``vtprune run``."""
    group = parser.add_argument_group("video")
    group.add_argument("--video", default=None,
                       help="video file: answer --question about it (decord, PyAV fallback; write a test clip "
                            "with `vtprune sample --video clip.mp4`)")
    group.add_argument("--frames", type=int_range(1, MAX_FRAMES), default=None,
                       help=f"frames sampled uniformly, 1..{MAX_FRAMES} (default 8; with --gridprobe K: K*K)")
    group.add_argument("--gridprobe", type=int_range(1, MAX_GRID), default=None, metavar="K",
                       help="select frames with GridProbe on a KxK grid (2K probes), then answer once")
    group.add_argument("--options", default=None,
                       help="multiple-choice options, e.g. 'A) red;B) blue;C) green' (default: open-ended)")
    group.add_argument("--frame-budget", default="global", choices=("global", "per_frame"),
                       help="token budget over all frames (global) or each frame its own keep fraction")
    group.add_argument("--probe-pixels", type=int_range(MIN_PROBE_PIXELS, MAX_PROBE_PIXELS), default=224 * 224,
                       help=f"pixels per frame in GridProbe probes ({MIN_PROBE_PIXELS}..{MAX_PROBE_PIXELS})")
    group.add_argument("--selector", default=None, help="model spec of the GridProbe selector (default: --model)")
    group.add_argument("--video-backend", default="auto", choices=("auto", "decord", "pyav"),
                       help="video reader (auto: decord, then PyAV)")
    group.add_argument("--route", default="auto", choices=("auto", "video", "images"),
                       help="model's video processor (video) or frames as images; auto: video when available")
    group.add_argument("--measure-baseline", action="store_true",
                       help="also time the monolithic all-candidates pass (time ratio)")


def video_only_options(args: argparse.Namespace) -> list[str]:
    """The video options given on a command line without ``--video`` (an image run would silently ignore them)."""
    defaults = {"frames": None, "gridprobe": None, "frame_budget": "global", "probe_pixels": 224 * 224,
                "selector": None, "video_backend": "auto", "route": "auto", "measure_baseline": False}
    return ["--" + name.replace("_", "-") for name, default in defaults.items()
            if getattr(args, name, default) != default]


def command_run_video(args: argparse.Namespace) -> int:
    """Answer ``args.question`` about ``args.video``; prints the answer, M_eff, frames and compute ratio."""
    from vtprune.cli.options import check_depth, final_keep, pruning_choice
    from vtprune.gridprobe.run import run_gridprobe
    from vtprune.media.video import load_video
    from vtprune.models.embedded import default_video_spec
    from vtprune.models.loading import check_load, check_model_spec, load, model_label
    from vtprune.models.vocabulary import question_note

    if not (args.question or "").strip():
        raise UserError("--video needs --question TEXT (a non-empty question about the video).")
    from vtprune.cli.checks import check_question

    check_question(args.question)
    if args.options is not None:
        from vtprune.gridprobe.probe import parse_options

        try:
            parse_options(args.options)
        except ValueError as error:
            message = str(error) if "--options" in str(error) else f"--options {args.options!r}: {error}"
            raise UserError(f"{message.rstrip('.')}; write e.g. --options 'A) red;B) blue'.") from None
    k = args.gridprobe
    frames = args.frames or (k * k if k else 8)
    args.model = args.model or default_video_spec()
    check_load(args.model, args.device, args.attn, args.dtype)
    if args.selector:
        check_model_spec(args.selector)
    pruning = pruning_choice(args)
    check_depth(pruning, args.model)
    clip = load_video(args.video, frames, args.video_backend)
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    _check_prompt(model, processor, clip, args, k)
    selector = load(args.selector, args.attn, args.dtype, args.device) if args.selector else None
    result = run_gridprobe(model, processor, clip, args.question, args.options, k=k, selector=selector,
                           token_method=pruning.method, keep=pruning.keep, frame_budget=args.frame_budget,
                           wrap_options=pruning.options, probe_pixels=args.probe_pixels, route=args.route,
                           max_new_tokens=args.max_new_tokens, measure_baseline=args.measure_baseline)
    record = result.as_dict()
    record.pop("selection")
    if result.selection is not None:
        sel = result.selection
        record.update(skew=sel.skew, kurtosis=sel.kurtosis, shape=sel.shape, row_confidence=sel.row_confidence,
                      column_confidence=sel.column_confidence)
    record.update(video=str(args.video), video_backend=clip.backend, video_frames=clip.total_frames,
                  video_fps=clip.fps, frames_sampled=len(clip), question=args.question, method=pruning.method,
                  keep=final_keep(pruning), requested_keep=pruning.asked, options=pruning.options, frame_budget=args.frame_budget, model=model_label(args.model),
                  selector=model_label(args.selector) if args.selector else None, dtype=args.dtype,
                  attn_implementation=args.attn, device=str(next(model.parameters()).device))
    from vtprune.media.images import crop_note

    crop = crop_note(processor, clip.frames[0].size)
    vocabulary = question_note(processor, args.question, record["model"].startswith("embedded"))
    record["debias"] = requested_debias(pruning)
    record["notes"] = (list(record.get("notes", [])) + pruning.notes + ([f"frames: {crop}"] if crop else [])
                       + ([vocabulary] if vocabulary else []))
    if args.json:
        print(json.dumps(record))
        return 0
    _print_video(record)
    return 0


def requested_debias(pruning) -> str | None:
    """Debiasing as asked (``+debias`` or ``--debias``): a calibration file, 'on', or None."""
    option = pruning.options.get("debias")
    if isinstance(option, str):
        return f"calibration {option}"
    if option or (option is None and pruning.method.endswith("+debias")):
        return "on (the model's calibration.json, else the default trend)"
    return None


def _check_prompt(model, processor, clip, args: argparse.Namespace, k: int | None) -> None:
    """Refuse a question whose prompt cannot fit the context (with one frame; with all of them without K)."""
    from vtprune.gridprobe.run import question_prompt
    from vtprune.media.video import frame_inputs, video_route
    from vtprune.models.pipeline import check_prompt_length

    prompt = question_prompt(args.question, args.options)[0]
    route = video_route(processor, args.route)
    frames = clip.frames if k is None else clip.frames[:1]
    ids = frame_inputs(processor, model.config.model_type, [frames], [prompt], route)["input_ids"]
    what = f"the prompt with {len(frames)} frame(s)" if k is None else "the prompt with a single frame"
    check_prompt_length(model, ids, args.max_new_tokens, what=what)


def _print_video(r: dict) -> None:
    from vtprune.cli.options import keep_label

    print(f"model     {r['model']} ({r['device']}, {r['dtype']}, {r['attn_implementation']})"
          + (f", selector {r['selector']}" if r["selector"] else ""))
    print(f"video     {r['video']}: {r['video_frames']} frames at {r['video_fps']:.2f} fps ({r['video_backend']}), "
          f"{r['frames_sampled']} sampled, route {r['route']}")
    print(f"question  {r['question']}")
    probs = r.get("letter_probs")
    print(f"answer    {r['answer']}" + (f"   (P = {probs[r['letter']]:.3f})" if probs else ""))
    if r["k"]:
        print(f"gridprobe K={r['k']}: M_eff = {r['m_eff']} of {r['k'] ** 2} (skew {r['skew']:.2f}, "
              f"kurtosis {r['kurtosis']:.2f}, shape {r['shape']:.2f})"
              + (f"; probe ensemble {r['probe_ensemble']}" if r["probe_ensemble"] else ""))
    else:
        print(f"frames    all {r['m_eff']} sampled frames (no --gridprobe)")
    times = ", ".join(f"{t:.2f}s" for t in r["times_selected"])
    print(f"selected  frames {r['frames_selected']} at [{times}]")
    debias = f", debias {r['debias']}" if r.get("debias") else ""
    debias += ", parity: release" if r["options"].get("parity") == "release" else ""
    keep = keep_label(r["keep"], r["requested_keep"], r["options"])
    print(f"pruning   {r['method']} {keep} ({r['frame_budget']}{debias}): {r['answer_visual_tokens']} visual tokens "
          f"-> {r['answer_kept_tokens']} kept")
    line = (f"compute   {r['flops_ratio']:.3f}x the all-frames pass in LM FLOPs (probes {r['probe_flops'] / 1e9:.3f} + "
            f"answer {r['answer_flops'] / 1e9:.3f} vs {r['baseline_flops'] / 1e9:.3f} GFLOP)")
    print(line)
    timing = f"time      probes {r['probe_ms']:.1f} ms + answer {r['answer_ms']:.1f} ms"
    if r["time_ratio"] is not None:
        timing += f" = {r['time_ratio']:.3f}x the all-frames pass ({r['baseline_ms']:.1f} ms)"
    print(timing)
    for note in r["notes"]:
        print(f"note      {note}")
