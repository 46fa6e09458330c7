"""``vtprune demo``: launch the Gradio demo of the checkout's ``demos/app.py``.

The demo's UI lives in the repository folder ``demos/`` (not installed by ``pyproject.toml``); the model side
is :mod:`vtprune.demo.app`. This module finds ``demos/`` at the root of the checkout vtprune is installed from
(an editable install, ``pip install -c constraints.txt -e ".[demo]"``) and imports it as the package ``demos``.
Moved from ``vtprune.eval.demo_cli`` (the old path imports for one release, with a ``DeprecationWarning``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from vtprune.cli.checks import OneLineParser, int_range
from vtprune.errors import install_extra

DEMOS_DIR = Path(__file__).resolve().parents[2] / "demos"  # vtprune/demo/cli.py -> the checkout's demos/


def demos_dir() -> Path:
    """The checkout's ``demos/`` folder; ``FileNotFoundError`` (with what to do) when it is not there."""
    if not (DEMOS_DIR / "app.py").is_file():
        raise FileNotFoundError(
            f"the Gradio demo needs the repository's demos/ folder, expected at {DEMOS_DIR}, which is missing: "
            f"vtprune is installed without its checkout. Install from a clone with `{install_extra('demo')}` "
            "and run `vtprune demo` (or `python demos/app.py`) there."
        )
    return DEMOS_DIR


def load_demo_module(name: str = "app") -> ModuleType:
    """Import ``demos.<name>`` from the checkout (registers the ``demos`` package in ``sys.modules``)."""
    folder = demos_dir()
    package = sys.modules.get("demos")
    if package is None or Path(getattr(package, "__file__", "") or "").parent != folder:
        spec = importlib.util.spec_from_file_location(
            "demos", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["demos"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"demos.{name}")


DESCRIPTION = ("Gradio demo of vtprune: one image (or video) and question, answered unpruned and pruned,\n"
               "side by side, in the browser at http://HOST:PORT.")


def add_demo_options(demo: argparse.ArgumentParser) -> None:
    """The demo's options, shared by ``vtprune demo`` and ``python demos/app.py`` (the same --help)."""
    demo.description = DESCRIPTION
    demo.add_argument("--model", default=None,
                      help="folder or hub id; 'embedded:llava' (default), 'embedded:qwen2_vl', 'tiny:<type>'")
    demo.add_argument("--host", default="127.0.0.1",
                      help="interface to bind (default 127.0.0.1, this machine only; the demo has no authentication)")
    demo.add_argument("--port", type=int_range(1, 65535), default=7860, help="port (default 7860)")
    demo.add_argument("--share", action="store_true", help="also open a public Gradio share link (off by default)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``vtprune demo [--model PATH] [--host 127.0.0.1] [--port N] [--share] [--device D]``."""
    demo = subparsers.add_parser("demo", help="launch the Gradio demo (pruned vs unpruned, side by side)")
    add_demo_options(demo)
    demo.set_defaults(func=command_demo)


def demo_parser() -> argparse.ArgumentParser:
    """The parser of ``python demos/app.py``: the same options, help and examples as ``vtprune demo``."""
    from vtprune.cli.help import EPILOGS, HelpFormatter

    parser = OneLineParser(prog="python demos/app.py", formatter_class=HelpFormatter, epilog=EPILOGS["demo"])
    add_demo_options(parser)
    return parser


def command_demo(args: argparse.Namespace) -> int:
    """Build the app for ``--model`` and serve it until interrupted (a bad option: one ``vtprune: error:`` line,
    before Gradio is imported)."""
    from vtprune.cli.checks import check_port
    from vtprune.models.loading import check_device, check_model_spec

    check_port(args.host, args.port)
    check_model_spec(args.model)
    check_device(args.device)
    return load_demo_module("app").serve(args)
