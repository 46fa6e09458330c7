"""Shared by the kernel tests (``test_kernels*.py``): dtypes, tolerances, seeded generators, and the marker of
the Triton paths.

The Triton paths run through the Triton CPU interpreter: TRITON_INTERPRET=1 is set before any Triton kernel
module is imported (``load_triton_module`` re-imports one defined without it). The interpreter costs ~1 ms per
program instance, so Triton shapes stay small (up to 577 tokens/keys, 2880 for top-k); the attention kernel's
577-key case uses few heads/queries, and larger shapes are left to the torch paths and the GPU benchmark.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from vtprune.kernels import _dispatch  # noqa: E402

INF = float("inf")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MERGE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}  # fp32 math on the same inputs
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not _dispatch.triton_available(),
    reason="Triton paths are tested on CPU through TRITON_INTERPRET=1",
)
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
