"""Test-wide settings: one torch thread (CI machines have 2 cores, and threads thrash under contention)."""

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
