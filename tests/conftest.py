"""Test-wide settings: one torch thread (CI machines have 2 cores, and threads thrash under contention)."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)
