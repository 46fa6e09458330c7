"""Test-wide settings: one torch thread per process (CI machines have 2 cores and test.sh runs two pytest-xdist
workers; more threads thrash under contention), restored after any test that changes it; the order of the
test files (see ``pytest_collection_modifyitems``)."""

import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process and the subprocesses the tests start
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)
if not torch.cuda.is_available():  # Triton kernels run through the CPU interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Test helper modules (e.g. the independent reference) are imported by name.
sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


@pytest.fixture
def cli(capsys):
    """``cli(*argv) -> (exit code, stdout, stderr)`` of ``vtprune`` run in this process."""
    from vtprune.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = main(list(argv))
        except SystemExit as error:
            code = int(error.code)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test (the errors under test must come before it), and CUDA looks absent."""
    import vtprune.models.loading

    monkeypatch.setattr(vtprune.models.loading, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The seconds of every ``time.sleep`` in the test's own thread (still slept). A check that something answers
    at once without network retries counts their back-off sleeps instead of timing the answer: a loaded machine
    must not fail a test for time alone."""
    import threading
    import time

    slept: list[float] = []
    mine, real = threading.current_thread(), time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is mine:
            slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """A test that sets torch's thread count (a CLI's ``--threads``, a training run) leaves it at one again."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Test files holding a ``slow`` test first, then the files with more tests (each file's order kept): test.sh
    hands whole files to its pytest-xdist workers (``--dist loadfile --no-loadscope-reorder``: module fixtures and
    cached models are built once), so the long files start early and no worker ends alone on one."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow, -count[item.path]))
