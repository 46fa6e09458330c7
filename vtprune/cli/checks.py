"""Argument checks of the command line, run before any work or model loading (no torch imported here).

argparse ``type=`` callables (:func:`positive_int`, :func:`int_range`, :func:`number_range`, :func:`keep_fraction`,
:func:`keep_list`, :func:`name_list`) make ``parser.error`` print one line, ``vtprune <cmd>: error: ... (see
`vtprune <cmd> -h`)``, exit status 2 (:class:`OneLineParser`: no usage block);
the ``check_*`` functions raise :class:`~vtprune.errors.UserError`, which :func:`vtprune.cli.main` prints as
one line.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path

from vtprune.errors import UserError

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "auto")
# the prompt placeholders processors expand into visual tokens (LLaVA family, Qwen-VL family)
VISUAL_PLACEHOLDERS = ("<image>", "<video>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` parser whose errors are one line, ``PROG: error: MESSAGE (see PROG -h)``, exit status 2.

    Subcommand parsers made by ``add_subparsers`` inherit the class, so every ``vtprune`` command reports a bad
    value in one line instead of the usage block followed by the error.
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} -h`)\n")


def model_type_of(target: str) -> str | None:
    """The ``model_type`` of a checked model target (a ``tiny:`` spec, a folder or a cached hub id), no weights read."""
    if target.startswith("tiny:"):
        return target.split(":", 1)[1]
    from vtprune.models.loading import raw_config

    return raw_config(target).get("model_type")


def check_question(question: str | None, flag: str = "--question") -> None:
    """Refuse a question holding a visual placeholder: the prompt template adds one per image or video."""
    for placeholder in VISUAL_PLACEHOLDERS:
        if question and placeholder in question:
            raise UserError(f"{flag} contains {placeholder!r}, a placeholder the prompt template adds for each image "
                            f"or video itself; remove it from the question.")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return int_range(1)(text)


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type factory: an integer in ``[low, high]`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number_range(low: float | None = None, high: float | None = None, above: bool = False) -> Callable[[str], float]:
    """argparse type factory: a finite number ``>= low`` (``> low`` with ``above``) and ``<= high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = low is not None and (value <= low if above else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            bounds = [f"{'>' if above else '>='} {low:g}" if low is not None else "",
                      f"<= {high:g}" if high is not None else ""]
            raise argparse.ArgumentTypeError(f"must be a number {' and '.join(b for b in bounds if b) or 'that is finite'}"
                                             f", got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def keep_fraction(text: str) -> float:
    """argparse type: a keep fraction in ``(0, 1]``."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}") from None
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"keep must be in (0, 1] (the fraction of visual tokens kept), got {text!r}")
    return value


def keep_list(text: str) -> str:
    """argparse type: a comma-separated, non-empty list of keep fractions (returned with blank items dropped)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated keep fractions such as '1,0.5,0.25', got {text!r}")
    refuse_repeats([keep_fraction(item) for item in items], items, text)
    return ",".join(items)


def name_list(text: str) -> str:
    """argparse type: a comma-separated, non-empty list of names."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated names such as 'none,fastv', got {text!r}")
    refuse_repeats(items, items, text)
    return ",".join(items)


def refuse_repeats(values: list, items: list[str], text: str) -> None:
    """argparse error for a list that names one value twice (it would run, and be reported, twice)."""
    for index, value in enumerate(values):
        if value in values[:index]:
            first = items[values.index(value)]
            same = f"{items[index]!r}" if items[index] == first else f"{first!r} and {items[index]!r}"
            raise argparse.ArgumentTypeError(f"{same} {'is' if items[index] == first else 'are'} listed twice in "
                                             f"{text!r}; give each value once")


def known_methods(requested: list[str], flag: str = "--methods") -> list[str]:
    """``requested`` when vtprune has every method (``+debias`` allowed; ``none`` is the unpruned reference); a
    :class:`UserError` names the first unknown one and the known names."""
    from vtprune.methods import list_methods

    known = set(list_methods()) | {"none"}
    for name in requested:
        if name.split("+")[0] not in known:
            raise UserError(f"{flag}: unknown method {name!r}; known: {', '.join(sorted(known))} (see `vtprune info`).")
    return requested


def check_output_file(path: str | Path, flag: str = "--out") -> Path:
    """Refuse an output file path that is a folder or cannot be written (nothing is created here)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a folder; give a file path, e.g. {flag} {Path(path) / 'result.json'}.")
    if target.exists() and not os.access(target, os.W_OK):
        raise UserError(f"{flag} {str(path)!r} exists and is not writable; choose another path.")
    _check_creatable(target.parent, path, flag)
    return target


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """Refuse an output folder that is a file or cannot be created / written (nothing is created here)."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a file; give a folder path for the outputs.")
    if target.is_dir() and not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(path)!r} is not writable; choose another folder.")
    _check_creatable(target, path, flag)
    return target


def _check_creatable(folder: Path, path: str | Path, flag: str) -> None:
    """The nearest existing ancestor of ``folder`` must be a writable folder."""
    ancestor = folder.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {str(path)!r}: {ancestor} is a file, so no folder can be created under it.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {str(path)!r}: the folder {ancestor} is not writable; choose another path.")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, share: bool) -> str | None:
    """A warning when the demo is reachable from other machines (it has no authentication)."""
    reasons = []
    if not is_loopback(host):
        reasons.append(f"it listens on {host}, reachable from other machines on the network")
    if share:
        reasons.append("--share opens a public gradio.live link that anyone with the address can use")
    if not reasons:
        return None
    return ("WARNING: the demo has no authentication and " + "; ".join(reasons) + ". Anyone who reaches it can "
            "run the model and upload files. Bind to 127.0.0.1 (the default) unless that is what you want.")


def check_port(host: str, port: int) -> None:
    """Refuse a port outside 1..65535 or one that another process already listens on."""
    if not 0 < port < 65536:
        raise UserError(f"--port {port} is not a TCP port; use a number in 1..65535.")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener still refuses; TIME_WAIT does not
        try:
            probe.bind((host.strip("[]"), port))
        except socket.gaierror as error:
            raise UserError(f"--host {host!r} is not an address of this machine ({error}).") from error
        except OSError as error:
            raise UserError(f"cannot listen on {host}:{port} ({error.strerror or error}); the port is busy or "
                            "not allowed: choose another --port.") from error
