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
