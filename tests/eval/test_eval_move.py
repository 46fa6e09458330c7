"""``eval/`` by concern: the flat modules moved into subpackages, their old paths still
import for one release (the same module object, a ``DeprecationWarning``), ``python -m OLD`` still runs the
main, CHANGELOG.md lists every move, and the former ``python -m`` mains are kinds of ``vtprune bench``."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vtprune.eval._moved import MOVED

from vtprune.cli import main as cli
from vtprune.cli.commands import BENCH_KINDS

ROOT = Path(__file__).resolve().parents[2]
# what may stay flat in eval/: the package, the shims' table, a helper shared by every concern, and the
# serving benchmark (moved with the vLLM work)
FLAT = {"__init__", "_moved", "provenance"}


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_eval_keeps_no_flat_module_but_shims():
    for path in sorted((ROOT / "eval").glob("*.py")):
        if path.stem in FLAT:
            continue
        source = path.read_text()
        shim = f'alias("{path.stem}", __name__)' in source or "sys.modules[__name__] =" in source
        assert shim and len(source.splitlines()) <= 10, f"eval/{path.name} is neither moved nor a shim"


def test_every_old_path_warns_and_is_the_moved_module():
    """One fresh interpreter (earlier imports cannot hide a warning), every moved module."""
    code = ("import importlib, warnings, sys\n"
            f"moved = {MOVED!r}\n"
            "for old, new in moved.items():\n"
            "    with warnings.catch_warnings(record=True) as caught:\n"
            "        warnings.simplefilter('always')\n"
            "        module = importlib.import_module('vtprune.eval.' + old)\n"
            "    assert module is importlib.import_module(new), old\n"
            "    assert getattr(importlib.import_module('vtprune.eval'), old) is module, old\n"
            "    assert any(w.category is DeprecationWarning and new in str(w.message) for w in caught), old\n")
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_old_python_m_command_runs_the_moved_main_and_says_so():
    """The notice shows under Python's default warning filters (no ``-W``), naming the command to use now."""
    result = _python("-m", "vtprune.eval.long_debias", "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: vtprune bench long-debias" in result.stdout
    assert "vtprune.eval.long_debias moved to vtprune.eval.accuracy.long_debias" in result.stderr
    assert "run `vtprune bench long-debias` instead" in result.stderr


def test_the_changelog_lists_every_moved_path():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    rows = dict(re.findall(r"^\| `(vtprune\.eval\.\w+)` \| `([\w.]+)` \|", changelog, re.M))
    assert {f"vtprune.eval.{old}": new for old, new in MOVED.items()}.items() <= rows.items()


@pytest.mark.parametrize("kind", [k for k, (module, _) in BENCH_KINDS.items() if module])
def test_every_bench_kind_has_a_main(kind):
    assert callable(importlib.import_module(BENCH_KINDS[kind][0]).main)


def test_a_bench_kind_runs_its_own_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        cli(["bench", "plot-kernels", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vtprune bench plot-kernels")


def test_bench_help_lists_the_kinds(capsys):
    with pytest.raises(SystemExit):
        cli(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(f"\n  {kind} " in out for kind in BENCH_KINDS)


@pytest.mark.parametrize(("words", "flag"), [(["speed"], "speed"), (["video"], "video"), ([], None),
                                             (["accuracy"], None), (["--speed"], "speed"), (["--video"], "video")])
def test_speed_and_video_kinds_are_the_flags(words, flag, monkeypatch):
    """``vtprune bench speed`` runs what ``--speed`` runs (and ``video`` ``--video``); no kind is accuracy."""
    import vtprune.eval.accuracy.bench as bench
    import vtprune.eval.accuracy.video as video
    import vtprune.eval.speed.bench as speed

    ran = []
    monkeypatch.setattr(speed, "run_speed", lambda args: ran.append("speed"))
    monkeypatch.setattr(video, "run_video", lambda args: ran.append("video"))
    monkeypatch.setattr(bench, "run", lambda args: ran.append(None))
    monkeypatch.setattr("vtprune.models.loading.check_load", lambda *args: None)
    assert cli(["bench", *words, "--device", "cpu"]) == 0
    assert ran == [flag]


def test_a_kind_after_options_is_one_line(capsys):
    assert cli(["bench", "--device", "cpu", "kernels"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vtprune bench kernels ..." in err
