"""The ``vtprune`` command line: ``run``, ``info`` and the subcommands other modules register.

Subcommand modules expose ``register(subparsers)``; :data:`vtprune.cli.commands.COMMANDS` names them, and a
module is imported only when its command is chosen (``vtprune --help`` imports no torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from vtprune.cli.checks import OneLineParser, check_question, int_range, model_type_of
from vtprune.cli.commands import add_commands, bench_kind_main, run_bench_kind
from vtprune.cli.help import apply_help
from vtprune.cli.options import (
    add_pruning_arguments,
    debias_source,
    effective_keep,
    effective_stages,
    keep_label,
    pruning_choice,
)
from vtprune.errors import UserError, install_extra

MAX_SAMPLE = 9_999
OPTIONAL_PACKAGES = {"optuna": "bench", "matplotlib": "bench", "gradio": "demo", "av": "video", "decord": "video",
                     "cv2": "video", "lmms_eval": "eval", "accelerate": "eval"}


def wrap_options(args: argparse.Namespace) -> dict:
    """Keyword options for :func:`vtprune.wrap` from parsed pruning arguments (``--config`` merged in)."""
    return pruning_choice(args).options


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="answer a question about an image (or --video) with pruning")
    run.add_argument("--image", default=None,
                     help="image file (default: a generated vtprune-shapes test image, see --sample)")
    run.add_argument("--question", default=None,
                     help="question (default: the generated sample's first question; with --image: "
                          "'What is in the image?')")
    run.add_argument("--sample", type=int_range(0, MAX_SAMPLE), default=0,
                     help=f"which generated test sample to ask about when no --image is given, 0..{MAX_SAMPLE}")
    run.add_argument("--max-new-tokens", type=int_range(1, 4096), default=8,
                     help="longest answer, in tokens (the embedded models answer in 1-4)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    add_pruning_arguments(run)
    from vtprune.cli.video import add_video_arguments

    add_video_arguments(run)
    run.set_defaults(func=command_run)
    info = subparsers.add_parser("info", help="versions, CUDA, supported model types and methods")
    info.set_defaults(func=command_info)


def _sample(index: int, model: str | None = None):
    from vtprune.models.embedded import task_of

    if task_of(model) == "dense":
        from vtprune.shapes.dense import make_dense_split as make_split
    else:
        from vtprune.shapes.task import make_split
    sample = make_split("test", 1, offset=index)[0]  # sample `index` of the split, generated alone
    question = sample.questions[0]
    return sample.image, question.text, question.answer


def _question(args: argparse.Namespace, default: str) -> str:
    if args.question is not None and not args.question.strip():
        raise UserError("--question is empty; ask something, e.g. --question 'What color is the circle?'.")
    check_question(args.question)
    return args.question or default


def command_run(args: argparse.Namespace) -> int:
    if args.image is not None and getattr(args, "video", None) is not None:
        raise UserError("give either --image or --video, not both.")
    if getattr(args, "video", None) is not None:
        from vtprune.cli.video import command_run_video

        return command_run_video(args)
    if getattr(args, "options", None) is not None:
        raise UserError("--options (multiple-choice answers) applies to --video; for an image, write the choices "
                        "into --question.")
    from vtprune.cli.video import video_only_options

    ignored = video_only_options(args)
    if ignored:
        raise UserError(f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} to --video, not to an "
                        f"image{' (--image)' if args.image is not None else ''}; drop "
                        f"{'it' if len(ignored) == 1 else 'them'}, or give --video FILE.")
    from vtprune.cli.options import check_depth
    from vtprune.media.images import aspect_limit, open_image
    from vtprune.models.loading import check_load
    from vtprune.models.notes import empty_answer_note, input_notes

    target = check_load(args.model, args.device, args.attn, args.dtype)
    pruning = pruning_choice(args)
    check_depth(pruning, args.model)
    expected = None
    if args.image is None:
        image, question, expected = _sample(args.sample, args.model)
        question = _question(args, question)
    else:
        image = open_image(args.image, max_aspect=aspect_limit(model_type_of(target)))
        question = _question(args, "What is in the image?")
    record, processor = _answer(args, pruning, image, question)
    notes = input_notes(processor, question, record["model"].startswith("embedded"), image.size)
    notes.append(empty_answer_note(record["answer"], args.max_new_tokens))
    record["notes"] = pruning.notes + [note for note in notes if note]
    if expected is not None:
        record["expected"] = expected
    if args.json:
        print(json.dumps(record))
        return 0
    _print_run(record)
    return 0


def _answer(args: argparse.Namespace, pruning, image, question: str) -> tuple[dict, object]:
    """Load, wrap, answer: the run's record and the model's processor."""
    import vtprune
    from vtprune.models.loading import load, model_label
    from vtprune.models.pipeline import answer_questions

    model, processor = load(args.model, args.attn, args.dtype, args.device)
    handle = vtprune.wrap(model, pruning.method, keep=pruning.keep, **pruning.options)
    try:
        result = answer_questions(model, processor, [image], [question], handle, args.max_new_tokens,
                                  timing_repeats=3)[0]
    finally:
        handle.remove()
    return {"answer": result.answer, "method": handle.scorer.name, "debias": debias_source(handle),
            "keep": effective_keep(handle),
            "requested_keep": pruning.asked, "options": pruning.options, "stages": effective_stages(handle),
            "visual_tokens": result.visual_tokens,
            "kept_tokens": result.kept_tokens[-1] if result.kept_tokens else result.visual_tokens,
            "kept_per_stage": result.kept_tokens, "stage_layers": result.stage_layers,
            "kept_indices": result.kept_indices, "prefill_ms": round(result.prefill_ms, 3),
            "generate_ms": round(result.generate_ms, 3), "question": question,
            "model": model_label(args.model), "attn_implementation": args.attn, "dtype": args.dtype,
            "device": str(next(model.parameters()).device)}, processor


def _print_run(record: dict) -> None:
    print(f"model     {record['model']} ({record['device']}, {record['dtype']}, {record['attn_implementation']})")
    print(f"question  {record['question']}")
    print(f"answer    {record['answer']}" + (f"   (expected: {record['expected']})" if "expected" in record else ""))
    stages = ", ".join(f"layer {layer}: {kept}" for layer, kept in zip(record["stage_layers"], record["kept_per_stage"]))
    debias = f", debias: {record['debias']}" if record.get("debias") else ""
    keep = keep_label(record["keep"], record["requested_keep"], record["options"])
    parity = ", parity: release (the method's released rules)" if record["options"].get("parity") == "release" else ""
    print(f"method    {record['method']} {keep}{debias}{parity}")
    print(f"visual    {record['visual_tokens']} tokens -> {record['kept_tokens']} kept ({stages or 'no stage'})")
    print(f"prefill   {record['prefill_ms']:.2f} ms (median of 3, after warm-up)")
    for note in record.get("notes", []):
        print(f"note      {note}")


def command_info(args: argparse.Namespace) -> int:
    import platform

    import torch
    import transformers

    import vtprune
    from vtprune.adapters import supported_model_types
    from vtprune.methods import describe, list_methods

    print(f"vtprune {vtprune.__version__}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"python {platform.python_version()}")
    hint = ""
    if not torch.cuda.is_available():
        hint = ("  (a CPU build of torch: see docs/use_on_your_model.md, Install)" if torch.version.cuda is None
                else f"  (torch built for CUDA {torch.version.cuda}, but no GPU is visible: check nvidia-smi)")
    print(f"cuda available: {torch.cuda.is_available()}{hint}")
    print("model types: " + ", ".join(supported_model_types()))
    print("methods:")
    for name in list_methods():
        print(f"  {name:<12} {describe(name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``vtprune`` parser; a command's module is imported when the command is chosen (or its parser read),
    so ``vtprune --help`` imports no torch (:mod:`vtprune.cli.commands`)."""
    parser = OneLineParser(prog="vtprune")
    add_commands(parser)
    apply_help(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; bad user input is one ``vtprune: error: ...`` line and exit status 2 (bugs keep tracebacks).

    Set ``VTPRUNE_TRACEBACK=1`` to see the traceback of a user error too.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    kind = bench_kind_main(argv)  # `vtprune bench KIND ...`: the kind's own main and options
    if kind is not None:
        return run_reporting_errors(lambda: run_bench_kind(*kind), "vtprune")
    args = parse_command(build_parser(), argv)
    return run_reporting_errors(lambda: args.func(args), "vtprune")


def parse_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse a command line; only a command with ``passthrough`` (``serve``: vLLM's options) takes unknown options."""
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        parser.error(f"unrecognized option {argv[0]!r} before the command; write the command first, e.g. "
                     "`vtprune run --help`")
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "passthrough", None) is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.passthrough = list(extra)
    return args


def run_reporting_errors(command: Callable[[], int | None], program: str) -> int:
    """``command()``'s exit status; a user error is one ``PROGRAM: error: ...`` line and status 2, Ctrl-C 130.

    Bugs keep their traceback; ``VTPRUNE_TRACEBACK=1`` shows it for user errors too.
    """
    try:
        return int(command() or 0)
    except KeyboardInterrupt:
        print(f"{program}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        message = user_error_message(error)
        if message is None or os.environ.get("VTPRUNE_TRACEBACK"):
            raise
        print(f"{program}: error: {message}", file=sys.stderr)
        return 2


def user_error_message(error: BaseException) -> str | None:
    """The one-line message for an error caused by user input, or None for a bug (keep its traceback).

    User errors: :class:`UserError`; missing / unreadable paths; a missing optional package; a ``ValueError``
    raised by vtprune's own checks (wrap-time option validation).
    """
    if isinstance(error, UserError):
        return str(error)
    if isinstance(error, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError):
        return str(error)
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in OPTIONAL_PACKAGES:
        package = error.name.split(".")[0]
        return f"this command needs the optional package {package!r}: {install_extra(OPTIONAL_PACKAGES[package])}."
    if isinstance(error, ValueError) and _raised_by_vtprune(error):
        return str(error)
    return None


def _raised_by_vtprune(error: BaseException) -> bool:
    """Was ``error`` raised by a vtprune module (its own validation), not by torch / transformers?"""
    traceback = error.__traceback__
    module = ""
    while traceback is not None:
        module = traceback.tb_frame.f_globals.get("__name__", "")
        traceback = traceback.tb_next
    return module == "vtprune" or module.startswith("vtprune.")


if __name__ == "__main__":
    sys.exit(main())
