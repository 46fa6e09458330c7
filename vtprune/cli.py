"""The ``vtprune`` command line: ``run``, ``info`` and the subcommands other modules register.

Subcommand modules expose ``register(subparsers)`` and are imported lazily-cheap (no torch at import).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

COMMAND_MODULES = (
    "vtprune.cli",
    "vtprune.eval.bench",
    "vtprune.eval.calibrate_cli",
    "vtprune.eval.tune",
    "vtprune.eval.demo_cli",
)


def add_pruning_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that prunes shares (model, method, keep, schedule, attention)."""
    parser.add_argument("--model", default=None,
                        help="folder or hub id; default 'embedded:llava' (images) or 'embedded:qwen2_vl' (--video); 'tiny:<type>'")
    parser.add_argument("--method", default="fastv", help="pruning method (see `vtprune info`); 'fastv+debias' ok")
    parser.add_argument("--keep", type=float, default=0.25, help="fraction of visual tokens kept, in (0, 1]")
    parser.add_argument("--layer", type=int, default=None, help="single pruning layer K (layers >= K pruned)")
    parser.add_argument("--schedule", default=None, help="progressive stages, e.g. '2:0.5,8:0.25'")
    parser.add_argument("--config", default=None, help="method configuration file (from `vtprune tune`)")
    parser.add_argument("--debias", default=None,
                        help="debias attention scores: 'true' (model calibration or default trend) or a file")
    parser.add_argument("--attn", default="sdpa", help="attn_implementation: sdpa (default), eager, flash_attention_2")
    parser.add_argument("--dtype", default="float32", help="float32, float16, bfloat16")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def wrap_options(args: argparse.Namespace) -> dict:
    """Keyword arguments for :func:`vtprune.wrap` from parsed pruning arguments."""
    options = {"layer": args.layer, "schedule": args.schedule}
    debias = getattr(args, "debias", None)
    if debias is not None:
        options["debias"] = True if debias.lower() in ("true", "1", "yes") else debias
    if getattr(args, "config", None):
        from vtprune.methods import load_method_config

        options.update(load_method_config(args.config))
    return {k: v for k, v in options.items() if v is not None}


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser("run", help="answer a question about an image with pruning")
    run.add_argument("--image", default=None, help="image path (default: a generated vtprune-shapes sample)")
    run.add_argument("--question", default=None, help="question (default: the sample's question)")
    run.add_argument("--sample", type=int, default=0, help="index of the generated sample when no --image")
    run.add_argument("--max-new-tokens", type=int, default=8)
    run.add_argument("--json", action="store_true", help="print one JSON object")
    add_pruning_arguments(run)
    from vtprune.video_cli import add_video_arguments

    add_video_arguments(run)
    run.set_defaults(func=command_run)
    info = subparsers.add_parser("info", help="versions, supported model types and methods")
    info.set_defaults(func=command_info)


def _sample(index: int):
    from vtprune.eval.shapes import make_split

    sample = make_split("test", index + 1)[index]
    question = sample.questions[0]
    return sample.image, question.text, question.answer


def command_run(args: argparse.Namespace) -> int:
    if getattr(args, "video", None):
        from vtprune.video_cli import command_run_video

        return command_run_video(args)
    import vtprune
    from vtprune.loading import load, model_label
    from vtprune.pipeline import answer_questions

    expected = None
    if args.image is None:
        image, question, expected = _sample(args.sample)
        question = args.question or question
    else:
        from PIL import Image

        image = Image.open(args.image).convert("RGB")
        question = args.question or "What is in the image?"
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    handle = vtprune.wrap(model, args.method, keep=args.keep, **wrap_options(args))
    try:
        result = answer_questions(model, processor, [image], [question], handle, args.max_new_tokens,
                                  timing_repeats=3)[0]
    finally:
        handle.remove()
    record = {"answer": result.answer, "method": args.method, "keep": args.keep,
              "visual_tokens": result.visual_tokens,
              "kept_tokens": result.kept_tokens[-1] if result.kept_tokens else result.visual_tokens,
              "kept_per_stage": result.kept_tokens, "stage_layers": result.stage_layers,
              "kept_indices": result.kept_indices, "prefill_ms": round(result.prefill_ms, 3),
              "generate_ms": round(result.generate_ms, 3), "question": question,
              "model": model_label(args.model), "attn_implementation": args.attn, "dtype": args.dtype,
              "device": str(next(model.parameters()).device)}
    if expected is not None:
        record["expected"] = expected
    if args.json:
        print(json.dumps(record))
        return 0
    _print_run(record)
    return 0


def _print_run(record: dict) -> None:
    print(f"model     {record['model']} ({record['device']}, {record['dtype']}, {record['attn_implementation']})")
    print(f"question  {record['question']}")
    print(f"answer    {record['answer']}" + (f"   (expected: {record['expected']})" if "expected" in record else ""))
    stages = ", ".join(f"layer {layer}: {kept}" for layer, kept in zip(record["stage_layers"], record["kept_per_stage"]))
    print(f"method    {record['method']} keep={record['keep']}")
    print(f"visual    {record['visual_tokens']} tokens -> {record['kept_tokens']} kept ({stages or 'no stage'})")
    print(f"prefill   {record['prefill_ms']:.2f} ms (median of 3, after warm-up)")


def command_info(args: argparse.Namespace) -> int:
    import platform

    import torch
    import transformers

    import vtprune
    from vtprune.adapters import supported_model_types
    from vtprune.methods import METHODS, list_methods

    print(f"vtprune {vtprune.__version__}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"python {platform.python_version()}")
    print(f"cuda available: {torch.cuda.is_available()}")
    print("model types: " + ", ".join(supported_model_types()))
    print("methods:")
    for name in list_methods():
        print(f"  {name:<12} {METHODS[name].description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtprune", description="Visual-token pruning for Hugging Face VLMs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"vtprune: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
