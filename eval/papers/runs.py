"""The run folders of ``vtprune bench reproduce``: an earlier run under ``--out`` is continued, never replaced.

Each run writes ``OUT/runs/<model>/<run>/run.json`` (the options it runs with) before lmms-eval starts and
``wall_s.json`` once lmms-eval wrote its results: a run with both is *finished*. Before anything runs,
:func:`check_runs` looks at every planned run's folder:

* a finished run with the same options is reused (a cut ``reproduce`` continues where it stopped);
* a finished run made with other options (``--limit``, ``--batch-size``, ``--launcher``, ``--checkpoint``,
  ``--mmbench``, a dry run against checkpoints) or whose options were not recorded is refused in one line, so
  a table never mixes runs made differently; a dry run, which reruns everything, refuses any finished run;
* an unfinished run (cut before ``wall_s.json``) is started again from an empty folder, as is any run with
  ``--force``, so an older results file can never stand in for a run that failed.

The table (``table.md`` / ``table.csv``) is redrawn from the run folders on every call. No torch here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vtprune.errors import UserError

RUN_FILE = "run.json"
TIMING_FILE = "wall_s.json"
FOLDER_OPTIONS = ("--output_path", "--include_path")  # they follow --out, whatever its spelling


def run_options(argv: list[str], launcher: str, dry_run: bool) -> dict[str, str]:
    """What two runs must share to sit in one table: lmms-eval's options (``argv``: option-value pairs; the model
    arguments one by one, the folders aside), the launcher, and dry run or checkpoints."""
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    model_args = pairs.pop("--model_args", "")
    options = {"mode": "dry run" if dry_run else "checkpoints", "--launcher": "in process" if dry_run else launcher}
    options.update((key, value) for key, value in pairs.items() if key not in FOLDER_OPTIONS)
    options.update((f"--model_args {key}", value) for key, _, value in
                   (part.partition("=") for part in model_args.split(",") if part))
    return options


def finished(folder: Path) -> bool:
    """Did the run in ``folder`` end with its results file and its timing?"""
    return (folder / TIMING_FILE).is_file() and any(folder.rglob("*_results.json"))


def recorded(folder: Path) -> dict[str, str] | None:
    """The options ``folder``'s run recorded (None: not recorded, or unreadable)."""
    try:
        options = json.loads((folder / RUN_FILE).read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return options if isinstance(options, dict) else None


def check_runs(out: Path, planned: dict[str, dict[str, str]], force: bool, dry_run: bool) -> set[str]:
    """The planned runs (``{name: options}``) to reuse from ``out``; a :class:`UserError` naming the first finished
    run that this command would otherwise replace. ``force``: reuse nothing, refuse nothing."""
    reuse: set[str] = set()
    if force:
        return reuse
    for name, options in planned.items():
        folder = out / "runs" / name
        if not finished(folder):
            continue
        earlier = recorded(folder)
        if earlier == options and not dry_run:
            reuse.add(name)
            continue
        why = ("from an earlier dry run (a dry run reruns everything)" if earlier == options
               else f"made with other options ({difference(earlier, options)})")
        ways = "another --out" + ("" if dry_run else ", the earlier run's options to continue it,")
        raise UserError(f"--out {str(out)!r} already holds runs/{name}/{TIMING_FILE}, a finished run {why}; give "
                        f"{ways} or --force to replace it.")
    return reuse


def difference(earlier: dict[str, str] | None, now: dict[str, str]) -> str:
    """The options that differ, ``OPTION EARLIER, now NOW`` (two at most), for the refusal's line."""
    if earlier is None:
        return f"not recorded in {RUN_FILE}"
    keys = [key for key in dict.fromkeys([*earlier, *now]) if earlier.get(key) != now.get(key)]
    shown = [f"{key} {earlier.get(key, 'unset')}, now {now.get(key, 'unset')}" for key in keys[:2]]
    return "; ".join(shown) + (f"; {len(keys) - 2} more" if len(keys) > 2 else "")


def start_run(folder: Path, options: dict[str, Any]) -> None:
    """An empty ``folder`` holding only ``run.json`` (an unfinished or forced run starts from nothing)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / RUN_FILE).write_text(json.dumps({"options": options}, indent=1) + "\n")
