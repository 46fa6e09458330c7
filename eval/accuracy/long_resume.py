"""``vtprune bench long --resume``: continue a stopped run only when it was made with the same options.

The run records the options that change its records in ``OUT/run.json`` before its first answer, with the
mechanism ``vtprune bench reproduce`` uses for its runs (:mod:`vtprune.eval.papers.runs`: ``run.json``,
:func:`~vtprune.eval.papers.runs.recorded`, :func:`~vtprune.eval.papers.runs.difference`). ``--resume``
refuses, in one line and before any model is loaded, a ``records.jsonl`` whose run used other options and one
without ``run.json`` beside it (a file this command did not write). Each record carries its identity
(question index, question text, method, keep): a resumed run skips exactly the answers it already has, so a
run cut in the middle of a question finishes that question without duplicating its records. No torch here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vtprune.eval.papers.runs import RUN_FILE, difference, recorded

from vtprune.errors import UserError

JOURNAL = "records.jsonl"
# the options that change what records.jsonl holds (--threads, --out, --resume, --force do not)
SHARED = ("setting", "model", "methods", "keep", "split", "debias_file", "attn")
BY_SETTING = {"video": ("clips", "frames", "k"), "multi": ("images", "sets")}

RecordKey = tuple[int, str, str, float]  # (question index, question text, method, keep)


def run_options(args: argparse.Namespace) -> dict[str, str]:
    """``{option: value}`` of every option that changes the records of a run with ``args`` (values as text)."""
    names = SHARED + BY_SETTING[args.setting]
    return {f"--{name.replace('_', '-')}": _text(getattr(args, name)) for name in names}


def _text(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(_text(item) for item in value)
    return "" if value is None else str(value)


def check_resume(out: str | Path, options: dict[str, str]) -> None:
    """Refuse to continue ``out``'s ``records.jsonl`` unless ``run.json`` beside it records ``options``."""
    folder = Path(out).expanduser()
    if not (folder / JOURNAL).exists():
        return
    earlier = recorded(folder)
    if earlier is None:
        raise UserError(f"--resume: --out {str(out)!r} holds a {JOURNAL} without the {RUN_FILE} that bench long "
                        "writes beside it, so it is not this command's run; give another --out, or --force to "
                        "start again over it.")
    if earlier != options:
        raise UserError(f"--resume: the run in --out {str(out)!r} was made with other options "
                        f"({difference(earlier, options)}); give that run's options to continue it, another --out, "
                        "or --force to start again.")


def record_options(out: Path, options: dict[str, str]) -> None:
    """Write ``out/run.json`` (the options of the run whose records ``out/records.jsonl`` holds)."""
    (out / RUN_FILE).write_text(json.dumps({"options": options}, indent=1) + "\n")


def record_key(index: int, question: str, method: str, keep: float) -> RecordKey:
    """The identity of one answer of the run."""
    return int(index), str(question), str(method), round(float(keep), 6)


def resumed_records(journal: Path) -> set[RecordKey]:
    """The answers ``journal`` already holds (:func:`record_key`); a UserError naming the file and line if a line is
    not a complete bench_long record."""
    done = set()
    for number, line in enumerate(journal.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            done.add(record_key(record["item"], record["question"], record["method"], record["keep"]))
        except (ValueError, KeyError, TypeError) as error:
            raise UserError(f"--resume: {journal} line {number} is not a bench_long record ({type(error).__name__}); "
                            "delete that line (a run stopped mid-write) or start again without --resume.") from error
    return done
