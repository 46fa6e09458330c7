"""``--help`` of the command line: every default shown, examples under every command (no torch here)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Visual-token pruning for Hugging Face vision-language models (LLaVA, Qwen-VL).

Without --model every command uses the embedded model: a 2 M-parameter LLaVA shipped in the package,
trained only on the synthetic vtprune-shapes task. It answers questions such as 'What color is the
circle?' about images like those `vtprune sample` writes, not questions about photos. Pass
--model llava-hf/llava-1.5-7b-hf (or a folder) for a real model."""

EPILOGS: dict[str, str] = {
    "": """\
examples:
  vtprune info                                   versions, model types, methods
  vtprune run --sample 3                         one generated question, FastV keeping 25 %
  vtprune sample --image shapes.png              write an image the embedded model can answer about
  vtprune run --image shapes.png --question "What color is the circle?" --method pdrop --keep 0.25
  vtprune bench --images 10 --methods none,fastv,pdrop --keep 1,0.25
run `vtprune COMMAND --help` for the options of a command.""",
    "run": """\
examples:
  vtprune run --sample 3                                        a generated test question (default fastv, keep 0.25)
  vtprune run --image shapes.png --question "How many squares are there?" --method pdrop --keep 0.25
  vtprune run --method pdrop --schedule "1:0.5,3:0.25"         progressive stages (the embedded LM has 4 layers)
  vtprune run --method fastv+debias --keep 0.25 --json          one JSON object (kept indices per stage)
  vtprune run --video clip.mp4 --question "What color is the cross that appears in the video?" --gridprobe 4
  vtprune run --model llava-hf/llava-1.5-7b-hf --dtype float16 --device cuda --image photo.jpg \\
      --question "What is on the sofa?" --max-new-tokens 32

The embedded models know only the vtprune-shapes words and question forms (see `vtprune sample`); a
question with other words gets a warning and a guessed or empty answer.""",
    "sample": """\
examples:
  vtprune sample --image shapes.png                 a test image and the questions the embedded models answer
  vtprune sample --video clip.mp4 --index 2         a test clip (needs PyAV or OpenCV: the [video] extra)
  vtprune run --image shapes.png --question "What color is the circle?\"""",
    "bench": """\
examples:
  vtprune bench --images 10 --methods none,fastv,pdrop --keep 1,0.25 --out runs/bench-small    about 1 min on CPU
  vtprune bench --images 100                                  every method and keep (about half an hour)
  vtprune bench --speed --methods fastv --keep 0.25 --speed-tokens 576 --speed-batches 1 --repeats 5
                                                              measured vs FLOP-predicted speedup (about 5 min)
  vtprune bench --video --model embedded:qwen2_vl --clips 10 --open-ended
  vtprune bench kernels --device cpu --quick                  another kind: its own options (--help)""",
    "calibrate": """\
examples:
  vtprune calibrate --model embedded:llava --method pdrop --out runs/cal/llava.json
  vtprune run --method fastv --debias runs/cal/llava.json --keep 0.25
  vtprune calibrate --model llava-hf/llava-1.5-7b-hf --dtype float16 --data my_images/ --n 256 \\
      --out ~/.cache/vtprune/llava-1.5-7b-calibration.json""",
    "tune": """\
examples:
  vtprune tune --method vflowopt --budget 0.5 --trials 20 --out runs/tune/vflowopt.json
  vtprune run --method vflowopt --config runs/tune/vflowopt.json""",
    "demo": """\
examples:
  vtprune demo                                       http://127.0.0.1:7860 with the embedded LLaVA
  vtprune demo --model embedded:qwen2_vl --port 7861""",
    "info": """\
example:
  vtprune info          vtprune, torch and transformers versions, CUDA, supported model types, methods""",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and appends ``(default: X)`` to options whose help does not say it.

    Options whose default is None or False say what they default to in their own text (for example
    ``--method``: fastv, or the ``--config`` file's method), so nothing is printed as ``default: None``.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


def apply_help(parser: argparse.ArgumentParser) -> None:
    """Give the top-level parser and every subcommand the formatter and their examples."""
    parser.formatter_class = HelpFormatter
    parser.description = DESCRIPTION
    parser.epilog = EPILOGS[""]
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for name, sub in dict.items(action.choices):  # as registered: a lazy command is styled when it loads
            style_command(name, sub)


def style_command(name: str, sub: argparse.ArgumentParser) -> None:
    """The formatter and the examples of subcommand ``name``."""
    sub.formatter_class = HelpFormatter
    if name in EPILOGS:
        sub.epilog = EPILOGS[name]
