"""Reproduce the papers' tables with lmms-eval: the papers' numbers beside the measured ones, and each run's speed.

``vtprune bench reproduce`` reads the papers' numbers (``papers.csv``: one row per paper x
model x setting x benchmark, with its source), runs lmms-eval once per model x method x keep x options
(``vtprune_llava`` on llava-hf/llava-1.5-7b-hf and llava-v1.6-vicuna-7b-hf, ``vtprune_qwen_vl`` on
Qwen/Qwen2.5-VL-7B-Instruct, plus each model unpruned) with each paper's protocol
(:mod:`vtprune.eval.papers.protocols`; the task variants of :mod:`vtprune.eval.lmms_plugin.paper_tasks`), and
writes ``table.md`` / ``table.csv``: paper value, measured value, difference, the known protocol differences,
wall-clock seconds of the run and the measured prefill per sample. A finished run in ``--out`` made with the same
options is reused (a cut ``reproduce`` continues); one made with other options is refused unless ``--force``
(:mod:`vtprune.eval.papers.runs`), so the table never mixes runs made differently.

``--dry-run`` runs the same plan offline on CPU in a minute or two: the embedded models stand in for the
checkpoints and every benchmark is the local ``vtprune_shapes`` task (``--limit`` documents), so the table has
the papers' columns but the measured ones are *not* comparable to them. CI runs it
(``tests/eval/test_reproduce.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vtprune.eval.lmms_plugin.paper_tasks import write_paper_tasks
from vtprune.eval.papers.data import (
    BENCHMARKS,
    DRY_TASK,
    MMBENCH_TASKS,
    MODELS,
    PAPERS_CSV,
    RELATIVE,
    PaperRow,
    Setting,
    benchmark_task,
    load_papers,
    metric,
    row_setting,
)
from vtprune.eval.papers.protocols import method_args
from vtprune.eval.papers.runs import TIMING_FILE, check_runs, run_options, start_run

from vtprune.cli.checks import OneLineParser, check_output_dir

__all__ = ["BENCHMARKS", "MODELS", "RELATIVE", "PaperRow", "Setting", "load_papers", "main", "metric", "plan"]


def plan(rows: list[PaperRow], models: list[str] | None = None, methods: list[str] | None = None,
         mmbench: str = "judge", registered: set[str] | None = None) -> dict[Setting, list[str]]:
    """The runs to do, each with its lmms-eval tasks; every model also runs unpruned on all of its tasks.

    A row's run carries its options (``layer=3``, ``budget=average``): two rows of one method and keep that ran
    differently are two runs. ``mmbench``: ``judge`` (``mmbench_en_dev``) or ``static`` (``mmbench_en_dev_static``).
    ``registered``: the methods this vtprune has (``vtprune.list_methods()``); rows of other methods are not run
    (None: every row's method is assumed to exist).
    """
    runs: dict[Setting, set[str]] = {}
    for row in rows:
        setting = row_setting(row)
        if setting is None or (models and row.model not in models) or (methods and row.method not in methods + ["none"]):
            continue
        if registered is not None and row.method not in registered:
            continue
        names = RELATIVE.get(row.benchmark, (row.benchmark,))
        runs.setdefault(setting, set()).update(benchmark_task(b, row.model, mmbench, row.options) for b in names)
    for model in {s.model for s in runs}:
        everything = set().union(*(tasks for s, tasks in runs.items() if s.model == model))
        runs.setdefault(Setting(model, "none", 1.0), set()).update(everything)
    return {s: sorted(tasks) for s, tasks in sorted(runs.items(), key=lambda kv: (
        kv[0].model, kv[0].method != "none", kv[0].method, -kv[0].keep, kv[0].options))}


def model_args(setting: Setting, dry_run: bool, batch_size: int, checkpoints: dict[str, str] | None = None) -> str:
    """``--model_args`` of a run (the dry run: the embedded model on CPU, one thread); ``checkpoints`` maps a
    model key to a local folder that replaces its hub id (an offline GPU machine). The method's arguments come
    from :func:`vtprune.eval.papers.protocols.method_args`, the model's preprocessing from its ``protocol``."""
    model = MODELS[setting.model]
    method, _ = method_args(setting, dry_run)
    common = ",".join(filter(None, [f"method={setting.method},{method},batch_size={batch_size}", model.protocol]))
    if dry_run:
        return f"pretrained={model.dry_pretrained},{common},device=cpu,threads=1"
    return f"pretrained={(checkpoints or {}).get(setting.model, model.pretrained)},{common},{model.args}"


def lmms_argv(setting: Setting, tasks: list[str], out: Path, dry_run: bool, batch_size: int,
              limit: int | None, include_path: Path | None, checkpoints: dict[str, str] | None = None) -> list[str]:
    """The lmms-eval arguments of one run (after ``python -m lmms_eval``)."""
    argv = ["--model", MODELS[setting.model].lmms_model,
            "--model_args", model_args(setting, dry_run, batch_size, checkpoints),
            "--tasks", ",".join([DRY_TASK] if dry_run else tasks), "--output_path", str(out)]
    if include_path is not None:
        argv += ["--include_path", str(include_path)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    return argv


def results_file(out: Path) -> Path | None:
    """The newest lmms-eval results JSON under ``out`` (it adds a folder per ``pretrained=ORG/NAME``)."""
    found = sorted(out.rglob("*_results.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def run_subprocess(argv: list[str], out: Path, launcher: list[str]) -> dict[str, Any]:
    """One lmms-eval run in its own process (under ``launcher``, e.g. ``accelerate launch ...``)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lmms_eval.log", "w") as log:
        subprocess.run([*launcher, "-m", "lmms_eval", *argv], stdout=log, stderr=subprocess.STDOUT, check=False)
    found = results_file(out)
    if found is None:  # lmms-eval logs its errors and exits 0: the results file is the only sign of success
        raise RuntimeError(f"lmms-eval wrote no results in {out}; see {out / 'lmms_eval.log'}")
    return json.loads(found.read_text())


def run_in_process(argv: list[str], out: Path, task_manager: Any) -> dict[str, Any]:
    """The same run through ``lmms_eval.evaluator.simple_evaluate`` in this process (the dry run: one import)."""
    from lmms_eval.evaluator import simple_evaluate

    args = dict(zip(argv[::2], argv[1::2], strict=True))
    results = simple_evaluate(model=args["--model"], model_args=args["--model_args"], tasks=args["--tasks"].split(","),
                              limit=int(args["--limit"]) if "--limit" in args else None, task_manager=task_manager,
                              log_samples=False)
    out.mkdir(parents=True, exist_ok=True)
    kept = {key: results[key] for key in ("results", "config", "throughput") if key in results}
    (out / "dry_run_results.json").write_text(json.dumps(kept, indent=1, default=str))
    return kept


def planned_options(runs: dict[Setting, list[str]], args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """``{run name: the options it runs with}`` (:func:`vtprune.eval.papers.runs.run_options`)."""
    return {setting.name: run_options(lmms_argv(setting, tasks, args.out / "runs" / setting.name, args.dry_run,
                                                args.batch_size, args.limit, None, args.checkpoints),
                                      args.launcher, args.dry_run)
            for setting, tasks in runs.items()}


def execute(runs: dict[Setting, list[str]], args: argparse.Namespace,
            reuse: set[str] = frozenset()) -> dict[Setting, dict[str, Any]]:
    """Run every planned run, reusing the finished runs named in ``reuse``; returns ``{setting: {"results": file,
    "wall_s": seconds}}``."""
    options = planned_options(runs, args)
    task_manager = None
    if args.dry_run:
        from vtprune.eval.lmms_plugin.prepare import prepare

        include_path = prepare(args.out / "tasks", n_images=max(1, (args.limit or 12) // 5 + 1))
    else:
        include_path = write_paper_tasks(args.out / "tasks")
    done: dict[Setting, dict[str, Any]] = {}
    for number, (setting, tasks) in enumerate(runs.items(), start=1):
        out = args.out / "runs" / setting.name
        argv = lmms_argv(setting, tasks, out, args.dry_run, args.batch_size, args.limit, include_path,
                         args.checkpoints)
        timing = out / TIMING_FILE
        previous = results_file(out)
        if setting.name in reuse and previous is not None:
            print(f"[reproduce] {number}/{len(runs)} {setting.name}: reusing {previous}", flush=True)
            done[setting] = {"results": json.loads(previous.read_text()), **json.loads(timing.read_text())}
            continue
        start_run(out, options[setting.name])  # a cut or --force run starts from an empty folder
        print(f"[reproduce] {number}/{len(runs)} {setting.name}: lmms_eval {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        if args.dry_run:
            if task_manager is None:
                import vtprune.eval.lmms_plugin  # noqa: F401  (registers the vtprune models)
                from lmms_eval.tasks import TaskManager

                task_manager = TaskManager(include_path=str(include_path))
            results = run_in_process(argv, out, task_manager)
        else:
            results = run_subprocess(argv, out, shlex.split(args.launcher))
        wall = {"wall_s": time.perf_counter() - start}
        timing.write_text(json.dumps(wall))
        done[setting] = {"results": results, **wall}
    return done


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="vtprune bench reproduce", description=__doc__.splitlines()[0])  # errors: one line
    parser.add_argument("--dry-run", action="store_true",
                        help="offline on CPU: embedded models and the local vtprune_shapes task (not comparable)")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--methods", default=None, help="comma list of the methods of the data file (default: all of "
                        "them); the unpruned run of each model is always included")
    parser.add_argument("--out", type=Path, default=Path("runs/reproduce"),
                        help="folder (default runs/reproduce); a finished run there with the same options is reused")
    parser.add_argument("--launcher", default=f"{sys.executable}",
                        help="what starts lmms-eval, before '-m lmms_eval' (default: this Python; eight GPUs: "
                        "'accelerate launch --num_processes 8')")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per generate() call (default 16)")
    parser.add_argument("--limit", type=int, default=None,
                        help="documents per task (default: all; the dry run: 12)")
    parser.add_argument("--mmbench", choices=("auto", *MMBENCH_TASKS), default="auto",
                        help="MMBench scoring: judge (mmbench_en_dev, a GPT judge: OPENAI_API_KEY), static "
                        "(mmbench_en_dev_static, lmms-eval's regex rule, no key), auto (default: judge when "
                        "OPENAI_API_KEY is set, else static)")
    parser.add_argument("--print-commands", action="store_true",
                        help="write the task variants into OUT/tasks, print the lmms-eval commands and stop")
    parser.add_argument("--papers", type=Path, default=PAPERS_CSV, help="the papers' numbers (CSV)")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="MODEL=FOLDER",
                        help="a local copy of a model's checkpoint instead of its hub id, e.g. "
                        "llava-1.5-7b=/data/llava-1.5-7b-hf (repeatable)")
    parser.add_argument("--force", action="store_true",
                        help="rerun every planned run, replacing the finished runs an earlier call left in --out "
                        "(default: reuse those made with the same options, refuse the others)")
    return parser


def _choice(option: str, given: str | None, valid: list[str]) -> list[str] | None:
    """``given``'s comma list, or stop with one line naming the unknown values and the valid ones."""
    if not given:
        return None
    values = [value.strip() for value in given.split(",") if value.strip()]
    unknown = [value for value in values if value not in valid]
    if unknown or not values:
        raise SystemExit(f"vtprune bench reproduce: error: unknown {option} {', '.join(unknown) or repr(given)}; "
                         f"choose from {', '.join(valid)}.")
    return values


def _registered(rows: list[PaperRow], methods: list[str] | None) -> set[str]:
    """The methods this vtprune has; a data-file method it lacks is skipped with a note (refused if named)."""
    import vtprune

    registered = set(vtprune.list_methods())
    missing = sorted({r.method for r in rows if r.keep is not None} - registered - {"none"})
    if methods and set(methods) & set(missing):
        raise SystemExit(f"vtprune bench reproduce: error: --methods {', '.join(sorted(set(methods) & set(missing)))}: "
                         "not in this vtprune (vtprune.list_methods()); its rows stay in the table, not run.")
    if missing:
        print(f"[reproduce] not run (not in this vtprune): {', '.join(missing)}", file=sys.stderr, flush=True)
    return registered


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--batch-size and --limit must be at least 1.")
    if args.dry_run and args.limit is None:
        args.limit = 12
    args.checkpoints = {}
    for item in args.checkpoint:
        key, _, folder = item.partition("=")
        if key not in MODELS or not folder:
            parser.error(f"--checkpoint {item!r}: give MODEL=FOLDER with MODEL one of {', '.join(MODELS)}.")
        if not Path(folder, "config.json").is_file():
            parser.error(f"--checkpoint {item!r}: {folder} holds no config.json; give a saved checkpoint folder.")
        args.checkpoints[key] = folder
    if args.mmbench == "auto":
        args.mmbench = "judge" if os.environ.get("OPENAI_API_KEY") else "static"
    rows = load_papers(args.papers)
    models = _choice("--models", args.models, list(MODELS))
    methods = _choice("--methods", args.methods, sorted({r.method for r in rows if r.keep is not None} - {"none"}))
    registered = _registered(rows, methods)
    runs = plan(rows, models, methods, args.mmbench, registered)
    if not runs:
        parser.error("nothing to run: no row of the data file matches --models / --methods.")
    if args.print_commands:
        include_path = None if args.dry_run else write_paper_tasks(args.out / "tasks")
        for setting, tasks in runs.items():
            out = args.out / "runs" / setting.name
            print(shlex.join([*shlex.split(args.launcher), "-m", "lmms_eval",
                              *lmms_argv(setting, tasks, out, args.dry_run, args.batch_size, args.limit, include_path,
                                         args.checkpoints)]))
        return 0
    from vtprune.eval.papers import table as reproduce_table

    reuse = check_runs(check_output_dir(args.out), planned_options(runs, args), args.force, args.dry_run)
    done = execute(runs, args, reuse)
    lines = reproduce_table.table([r for r in rows if not models or r.model in models], done, args.dry_run, args.mmbench)
    conditions = reproduce_table.conditions(args.dry_run, args.batch_size, args.limit, args.launcher, args.mmbench)
    path = reproduce_table.write(lines, args.out, conditions, args.dry_run)
    print(path.read_text())
    print(f"[reproduce] wrote {path} and {path.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":  # run the imported module's main: its classes are the ones reproduce_table compares
    from vtprune.eval.papers import reproduce

    raise SystemExit(reproduce.main())
