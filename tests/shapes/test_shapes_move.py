"""The synthetic task moved from ``vtprune.eval.shapes*`` to ``vtprune.shapes``: the new
paths import without ``vtprune.eval``; the old ones still work for one release, as the same module objects,
with a ``DeprecationWarning``. Fresh interpreters, so earlier imports cannot hide a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MOVED = {"vtprune.eval.shapes": "vtprune.shapes.task", "vtprune.eval.shapes_dense": "vtprune.shapes.dense",
         "vtprune.eval.shapes_multi": "vtprune.shapes.multi", "vtprune.eval.shapes_video": "vtprune.shapes.video"}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)


def test_the_new_paths_and_their_users_import_no_vtprune_eval():
    code = ("import sys, importlib\n"
            f"for name in {sorted(MOVED.values())!r} + ['vtprune.models.vocabulary', 'vtprune.cli.sample']:\n"
            "    importlib.import_module(name)\n"
            "from vtprune.models.vocabulary import example_questions\n"
            "assert example_questions()\n"
            "loaded = [m for m in sys.modules if m.startswith('vtprune.eval')]\n"
            "assert not loaded, loaded\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_warns_and_is_the_moved_module(old, new):
    assert _run(f"import {old}").returncode != 0  # -W error: the import raises the DeprecationWarning
    code = (f"import warnings, importlib\nwith warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n    old = importlib.import_module({old!r})\n"
            f"assert old is importlib.import_module({new!r})\n"
            f"assert any(w.category is DeprecationWarning and {new!r} in str(w.message) for w in caught)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
