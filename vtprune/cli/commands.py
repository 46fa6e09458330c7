"""The subcommands of ``vtprune``, each registered by its module on first use.

``vtprune --help`` lists the commands from :data:`COMMANDS` alone, so it imports neither torch nor the
modules behind the commands. ``vtprune bench ...`` imports only ``vtprune.eval.accuracy.bench``: argparse looks the
chosen command up in the subparsers' map, and that look-up imports the command's module and lets its
``register(subparsers)`` replace the placeholder. ``vtprune bench KIND ...`` for a kind with its own ``main``
(:data:`BENCH_KINDS`: the former ``python -m vtprune.eval.*`` entry points) imports only that kind's module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any

from vtprune.cli.help import style_command

# name: (the module whose register(subparsers) adds it, the one-line help `vtprune --help` shows; a test
# checks that it equals the help the module registers). Order = order in `vtprune --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("vtprune.cli", "answer a question about an image (or --video) with pruning"),
    "info": ("vtprune.cli", "versions, CUDA, supported model types and methods"),
    "sample": ("vtprune.cli.sample", "write a vtprune-shapes test image or clip and its questions"),
    "bench": ("vtprune.eval.accuracy.bench", "accuracy / evidence recall / cost of methods x keep fractions"),
    "calibrate": ("vtprune.eval.tuning.calibrate_cli", "fit the positional attention trend used by debias"),
    "tune": ("vtprune.eval.tuning.tune", "optimise a method's hyperparameters under an average-retention budget"),
    "demo": ("vtprune.demo.cli", "launch the Gradio demo (pruned vs unpruned, side by side)"),
    "serve": ("vtprune.vllm.serve", "start vLLM's OpenAI-compatible server with visual-token pruning"),
}


# vtprune bench KIND: (the module whose main(argv) runs it, or None for the kinds of vtprune.eval.accuracy.bench's
# own parser; the one-line help `vtprune bench --help` lists). Each module is imported only when its kind runs.
BENCH_KINDS: dict[str, tuple[str | None, str]] = {
    "accuracy": (None, "the default: accuracy / evidence recall / cost on vtprune-shapes images"),
    "speed": (None, "= --speed: generate() end to end, prefill, decode, memory on random-weight speed proxies"),
    "video": (None, "= --video: frame selection x token pruning on the vtprune-shapes video split"),
    "long": ("vtprune.eval.accuracy.long", "long visual contexts: every frame of a clip, or 2-8 images per prompt"),
    "long-debias": ("vtprune.eval.accuracy.long_debias", "the recency trend at 256-512 tokens, from calibrate files"),
    "followup": ("vtprune.eval.accuracy.followup", "a second question answered on a pruned cache vs re-prefilled"),
    "tower-queries": ("vtprune.eval.accuracy.tower_queries", "VisionZip on large Qwen-VL towers: every query vs few"),
    "footprint": ("vtprune.eval.speed.footprint", "what the engine costs a server: hook time, host syncs, memory"),
    "speed-report": ("vtprune.eval.speed.report", "Markdown table and plots of a speed CSV (--merge: reruns)"),
    "kernels": ("vtprune.eval.kernels.bench", "the kernels: Triton vs their torch twins, latency per size"),
    "plot-kernels": ("vtprune.eval.kernels.plot", "one PNG per kernel from the kernel benchmark CSVs"),
    "serving": ("vtprune.eval.speed.serving", "vLLM with the plugin: requests/s, TTFT, TPOT, pruned vs unpruned"),
    "reproduce": ("vtprune.eval.papers.reproduce", "the papers' tables with lmms-eval, beside the papers' numbers"),
    "lmms-prepare": ("vtprune.eval.lmms_plugin.prepare", "write the vtprune-shapes lmms-eval tasks and their data"),
    "train": ("vtprune.eval.training.train", "train an embedded tiny VLM from scratch on CPU"),
    "train-dense": ("vtprune.eval.training.dense", "the 64-token model's git checkpoint (compact SRC DST)"),
}


def bench_kinds_help() -> str:
    """The ``KIND`` list of ``vtprune bench --help`` (from :data:`BENCH_KINDS`, nothing imported)."""
    width = max(map(len, BENCH_KINDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in BENCH_KINDS.items()]
    return "kinds (vtprune bench KIND --help: the options of KIND):\n" + "\n".join(lines)


def bench_kind_main(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``(kind, module, its argv)`` when ``argv`` is ``bench KIND ...`` for a kind with its own ``main``, else None.

    The kind must follow ``bench`` directly: its options are the kind's own, not ``vtprune bench``'s.
    """
    if len(argv) < 2 or argv[0] != "bench":
        return None
    module = BENCH_KINDS.get(argv[1], (None, ""))[0]
    return None if module is None else (argv[1], module, argv[2:])


def run_bench_kind(kind: str, module: str, argv: list[str]) -> int:
    """Run ``module.main(argv)`` as ``vtprune bench KIND`` (its usage line says so); its exit status."""
    program, sys.argv[0] = sys.argv[0], f"vtprune bench {kind}"  # argparse's default prog
    try:
        result = importlib.import_module(module).main(argv)
    finally:
        sys.argv[0] = program
    return result if isinstance(result, int) else 0  # mains that return the file they wrote succeeded


def installed(module: str) -> bool:
    """Is ``module`` importable here (``vtprune.eval`` and ``vtprune.vllm`` may be absent), without importing it?"""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


class LazyParsers(dict):
    """``{command: parser}`` of the subparsers action; reading a placeholder's entry registers the real parser."""

    def __init__(self, action: LazySubcommands) -> None:
        super().__init__()
        self.action = action

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        self.action.load(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def values(self) -> list[argparse.ArgumentParser]:  # type: ignore[override]
        return [self[name] for name in list(self)]

    def items(self) -> list[tuple[str, argparse.ArgumentParser]]:  # type: ignore[override]
        return [(name, self[name]) for name in list(self)]


class LazySubcommands(argparse._SubParsersAction):
    """Subparsers whose commands start as placeholders (name and help) and load their module when chosen."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._name_parser_map = self.choices = LazyParsers(self)
        self.pending: dict[str, str] = {}  # placeholder command -> module that registers it

    def add_placeholder(self, name: str, module: str, help: str) -> None:
        super().add_parser(name, help=help)
        self.pending[name] = module

    def load(self, name: str) -> None:
        """Import the module of placeholder ``name`` and let it register its commands (no-op once loaded)."""
        module = self.pending.get(name)
        if module is not None:
            importlib.import_module(module).register(self)

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A module's real parser replaces the placeholder of the same name (and its help line)."""
        if self.pending.pop(name, None) is not None:
            dict.__delitem__(self._name_parser_map, name)
            self._choices_actions = [a for a in self._choices_actions if a.dest != name]
        parser = super().add_parser(name, **kwargs)
        style_command(name, parser)
        return parser


def add_commands(parser: argparse.ArgumentParser) -> LazySubcommands:
    """The ``COMMAND`` subparsers of ``parser``, every installed command as a placeholder."""
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=LazySubcommands)
    for name, (module, summary) in COMMANDS.items():
        if installed(module):
            subparsers.add_placeholder(name, module, summary)
    return subparsers
