"""The modules that left ``eval/``'s flat layout for subpackages by concern, and the shims that keep their old
paths for one release.

Each old module ``eval/OLD.py`` is three lines calling :func:`alias`: imported, it is the moved module itself
(``sys.modules`` holds the same object, so attributes, monkeypatching and pickles agree) and a
``DeprecationWarning`` names the new path; run as ``python -m vtprune.eval.OLD`` it prints that notice on
stderr (Python's default filters would hide the warning there) and runs the moved module's ``__main__`` (the
new command is ``vtprune bench KIND``, :data:`vtprune.cli.commands.BENCH_KINDS`).
CHANGELOG.md lists the same table; ``tests/eval/test_eval_move.py`` checks both.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings

# old module name under vtprune.eval -> its new dotted path
MOVED: dict[str, str] = {
    "bench": "vtprune.eval.accuracy.bench",
    "bench_defaults": "vtprune.eval.accuracy.defaults",
    "bench_report": "vtprune.eval.accuracy.report",
    "bench_video": "vtprune.eval.accuracy.video",
    "bench_followup": "vtprune.eval.accuracy.followup",
    "bench_tower_queries": "vtprune.eval.accuracy.tower_queries",
    "bench_long": "vtprune.eval.accuracy.long",
    "long_debias": "vtprune.eval.accuracy.long_debias",
    "long_items": "vtprune.eval.accuracy.long_items",
    "long_report": "vtprune.eval.accuracy.long_report",
    "bench_speed": "vtprune.eval.speed.bench",
    "speed_measure": "vtprune.eval.speed.measure",
    "speed_memory": "vtprune.eval.speed.memory",
    "speed_proxy": "vtprune.eval.speed.proxy",
    "speed_report": "vtprune.eval.speed.report",
    "speed_rows": "vtprune.eval.speed.rows",
    "engine_footprint": "vtprune.eval.speed.footprint",
    "syncs": "vtprune.eval.speed.syncs",
    "bench_kernels": "vtprune.eval.kernels.bench",
    "plot_kernels": "vtprune.eval.kernels.plot",
    "train_tiny": "vtprune.eval.training.train",
    "tiny_models": "vtprune.eval.training.models",
    "tiny_qwen": "vtprune.eval.training.qwen",
    "tiny_dense": "vtprune.eval.training.dense",
    "tiny_eval": "vtprune.eval.training.evaluate",
    "tune": "vtprune.eval.tuning.tune",
    "tune_spaces": "vtprune.eval.tuning.spaces",
    "calibrate": "vtprune.eval.tuning.calibrate",
    "calibrate_cli": "vtprune.eval.tuning.calibrate_cli",
    "calibrate_kv": "vtprune.eval.tuning.calibrate_kv",
    "reproduce": "vtprune.eval.papers.reproduce",
    "reproduce_data": "vtprune.eval.papers.data",
    "reproduce_table": "vtprune.eval.papers.table",
    "demo_cli": "vtprune.demo.cli",
}


def alias(old: str, name: str) -> None:
    """Make ``vtprune.eval.<old>`` the moved module (``name`` is the shim's ``__name__``), with a warning.

    Run as a script (``name == "__main__"``), the moved module runs as ``__main__`` instead: the old
    ``python -m`` command keeps working for one release.
    """
    new = MOVED[old]
    if name == "__main__":
        print(f"DeprecationWarning: vtprune.eval.{old} moved to {new}; run {new_command(new)} instead (the old "
              "path will be removed in the next release; see CHANGELOG.md).", file=sys.stderr, flush=True)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(f"vtprune.eval.{old} moved to {new}; import it from there (the old path will be removed in "
                  "the next release; see CHANGELOG.md).", DeprecationWarning, stacklevel=3)
    sys.modules[f"vtprune.eval.{old}"] = importlib.import_module(new)


def new_command(module: str) -> str:
    """The command that runs ``module`` now: ``vtprune COMMAND``, ``vtprune bench KIND`` or ``python -m MODULE``."""
    from vtprune.cli.commands import BENCH_KINDS, COMMANDS

    commands = {where: f"vtprune {name}" for name, (where, _) in COMMANDS.items()}
    commands.update({where: f"vtprune bench {kind}" for kind, (where, _) in BENCH_KINDS.items() if where})
    return f"`{commands.get(module, 'python -m ' + module)}`"
