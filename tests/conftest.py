"""Test-wide settings: one torch thread per process (CI machines have 2 cores and test.sh runs two pytest-xdist
workers; more threads thrash under contention), restored after any test that changes it; modules with a ``slow``
test are collected first, so that parallel workers do not end on one long module."""

import os
import sys
from pathlib import Path

import torch

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


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """A test that sets torch's thread count (a CLI's ``--threads``, a training run) leaves it at one again."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Modules holding a ``slow`` test first (their order otherwise kept): a worker that draws one late would
    finish alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
