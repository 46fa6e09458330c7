"""``vtprune --help`` and ``import vtprune`` import no torch; the lazily registered
commands are the same commands with the same help. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _no_heavy_import(statement: str) -> str:
    """Python code: run ``statement``, then fail naming any of torch / transformers that got imported."""
    return (f"import sys\ntry:\n    {statement}\nexcept SystemExit:\n    pass\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\nassert not heavy, heavy\n")


def test_import_vtprune_imports_no_torch_and_the_public_names_still_resolve():
    code = _no_heavy_import("import vtprune; names = dir(vtprune)") + (
        "assert {'wrap', 'apply', 'load', 'PruneHandle', 'Scorer'} <= set(names)\n"
        "from vtprune import wrap, PruneConfig\n"
        "import vtprune.api\n"
        "assert vtprune.wrap is wrap is vtprune.api.wrap and vtprune.engine.PruneHandle is vtprune.PruneHandle\n"
        "assert 'fastv' in vtprune.list_methods()\n"
        "try:\n    vtprune.no_such_name\nexcept AttributeError as error:\n    assert 'no_such_name' in str(error)\n"
        "else:\n    raise SystemExit('vtprune.no_such_name resolved')\n")
    result = _python(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("command", ["", "run", "info", "sample", "bench", "calibrate", "tune", "demo", "serve"])
def test_help_imports_no_torch(command):
    argv = [c for c in (command, "--help") if c]
    result = _python(_no_heavy_import(f"import vtprune.cli; vtprune.cli.main({argv!r})"))
    assert result.returncode == 0, result.stderr
    assert "usage: vtprune" in result.stdout


def test_the_vtprune_script_answers_help_quickly_and_lists_every_command():
    script = Path(sys.executable).with_name("vtprune")
    if not script.exists():
        pytest.skip("the vtprune console script is not installed in this environment")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "120"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the command (a loaded machine stretches the wall clock, not these)
    seconds = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert result.returncode == 0, result.stderr
    from vtprune.cli.commands import COMMANDS

    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert set(COMMANDS) - {"serve"} <= listed  # serve: only where vtprune.vllm is installed
    assert seconds < 2.0, f"vtprune --help took {seconds:.2f} s of CPU"


def test_the_commands_table_matches_what_the_modules_register():
    """Each placeholder's help line equals the one its module registers; no module adds an unlisted command."""
    from vtprune.cli import build_parser
    from vtprune.cli.commands import COMMANDS, installed

    action = build_parser()._subparsers._group_actions[0]
    before = {a.dest: a.help for a in action._choices_actions}
    assert before == {name: summary for name, (module, summary) in COMMANDS.items() if installed(module)}
    parsers = dict(action.choices.items())  # reading the map loads every module
    after = {a.dest: a.help for a in action._choices_actions}
    assert after == before and set(parsers) == set(before) and action.pending == {}
    assert all(callable(parser.get_default("func")) for parser in parsers.values())  # real parsers


def test_a_chosen_command_loads_only_its_module():
    code = _no_heavy_import(
        "import vtprune.cli as c; args = c.build_parser().parse_args(['sample', '--index', '2'])") + (
        "assert args.command == 'sample' and args.index == 2 and callable(args.func)\n"
        "assert 'vtprune.eval.accuracy.bench' not in sys.modules and 'vtprune.eval.tuning.tune' not in sys.modules\n")
    result = _python(code)
    assert result.returncode == 0, result.stderr
