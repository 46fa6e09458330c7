"""The subcommands of ``vtprune``, each registered by its module on first use.

``vtprune --help`` lists the commands from :data:`COMMANDS` alone, so it imports neither torch nor the
modules behind the commands (``vtprune.eval.bench`` imports torch at the top). ``vtprune bench ...`` imports
only ``vtprune.eval.bench``: argparse looks the chosen command up in the subparsers' map, and that look-up
imports the command's module and lets its ``register(subparsers)`` replace the placeholder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from typing import Any

from vtprune.cli.help import style_command

# name: (the module whose register(subparsers) adds it, the one-line help `vtprune --help` shows; a test
# checks that it equals the help the module registers). Order = order in `vtprune --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("vtprune.cli", "answer a question about an image (or --video) with pruning"),
    "info": ("vtprune.cli", "versions, CUDA, supported model types and methods"),
    "sample": ("vtprune.cli.sample", "write a vtprune-shapes test image or clip and its questions"),
    "bench": ("vtprune.eval.bench", "accuracy / evidence recall / cost of methods x keep fractions"),
    "calibrate": ("vtprune.eval.calibrate_cli", "fit the positional attention trend used by debias"),
    "tune": ("vtprune.eval.tune", "optimise a method's hyperparameters under an average-retention budget"),
    "demo": ("vtprune.eval.demo_cli", "launch the Gradio demo (pruned vs unpruned, side by side)"),
    "serve": ("vtprune.vllm.serve", "start vLLM's OpenAI-compatible server with pre-LLM pruning"),
}


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
