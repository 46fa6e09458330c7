"""Outputs of the commands: an earlier run's results are never replaced without ``--force``.

Every command that writes into a file or folder the user names checks, before any work, that it would not
replace what an earlier run left there: a file it writes that already exists is refused in one line naming
the path and the ways out (another path, ``--resume`` where the command can continue, ``--force``).
Files a command only redraws from data it keeps beside them (a report from its CSV) are not results.
No torch here.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from vtprune.errors import UserError


def add_force_argument(parser: argparse.ArgumentParser, where: str = "--out") -> None:
    """``--force``: replace an earlier run's results (the default refuses and says so)."""
    parser.add_argument("--force", action="store_true",
                        help=f"replace the results an earlier run left in {where} (default: refuse, and say so)")


def check_new_file(path: str | Path, force: bool, flag: str = "--out") -> Path:
    """Refuse to replace an existing file at ``path`` (the value of ``flag``) unless ``force``."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir() and not force:
        raise UserError(f"{flag} {str(path)!r} already exists; give another path, or --force to replace it.")
    return target


def check_new_results(folder: str | Path, names: Iterable[str], force: bool, flag: str = "--out",
                      resume: bool = False) -> Path:
    """Refuse to write into ``folder`` (the value of ``flag``) when it holds any of ``names`` from an earlier run.

    ``names`` may hold glob patterns (``"*.png"``). ``resume``: the command can continue that run, so the
    message offers ``--resume`` too.
    """
    target = Path(folder).expanduser()
    if force or not target.is_dir():
        return target
    found = sorted({hit.name for name in names for hit in target.glob(name)})
    if found:
        held = found[0] + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
        ways = "another " + flag + (", --resume to continue that run," if resume else "")
        raise UserError(f"{flag} {str(folder)!r} already holds {held} from an earlier run; give {ways} or --force "
                        "to replace it.")
    return target
