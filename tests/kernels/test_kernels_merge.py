"""``vtprune.kernels.merge_tokens``: hand-computed case, the weighted-mean formula, Triton (interpreter) vs
the reference, and bad inputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_cases import DTYPES, MERGE_TOL, gen, needs_interpreter  # noqa: E402
from vtprune.kernels import (  # noqa: E402
    merge_tokens,
    merge_tokens_torch,
)

torch.set_num_threads(1)


def test_merge_hand_case() -> None:
    x = torch.tensor([[[1.0, 10.0], [3.0, 30.0], [5.0, 50.0], [7.0, 70.0]]])
    assign, weight = torch.tensor([[0, 0, 1, -1]]), torch.tensor([[1.0, 3.0, 1.0, 1.0]])
    want = torch.tensor([[[2.5, 25.0], [5.0, 50.0], [0.0, 0.0]]])  # (1*1+3*3)/4, 5, empty target -> 0
    assert torch.allclose(merge_tokens_torch(x, assign, weight, 3), want)
    assert torch.allclose(merge_tokens(x, assign, weight, 3), want)


def test_merge_matches_formula() -> None:
    g = gen(1)
    x, assign, weight = (
        torch.randn(2, 9, 4, generator=g),
        torch.randint(-1, 3, (2, 9), generator=g),
        torch.rand(2, 9),
    )
    out = merge_tokens_torch(x, assign, weight, 3)
    for b in range(2):
        for t in range(3):
            sel = assign[b] == t
            w = weight[b, sel]
            want = (w[:, None] * x[b, sel]).sum(0) / w.sum() if sel.any() else torch.zeros(4)
            assert torch.allclose(out[b, t], want, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (3, 7, 24, 3), (3, 577, 64, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_triton_matches_reference(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    bsz, n, dim, t = shape
    g = gen(n)
    x = torch.randn(bsz, n, dim, generator=g).to(dtype)
    assign = torch.randint(-1, t, (bsz, n), generator=g)
    weight = torch.rand(bsz, n, generator=g) * (torch.rand(bsz, n, generator=g) > 0.1)  # some zero weights
    out = merge_tokens(x, assign, weight, t, impl="triton")
    want = merge_tokens_torch(x, assign, weight, t)
    assert out.dtype == dtype and out.shape == (bsz, t, dim)
    atol, rtol = MERGE_TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "assign,weight,t,match",
    [
        ([[0, 3]], [[1.0, 1.0]], 3, r"assign\[0, 1\]=3 is outside"),
        ([[0, -2]], [[1.0, 1.0]], 3, r"assign\[0, 1\]=-2"),
        ([[0, 1]], [[1.0, -0.5]], 3, r"weight\[0, 1\]=-0.5"),
        ([[0, 1]], [[float("nan"), 1.0]], 3, r"weight\[0, 0\]=nan"),
        ([[0, 1, 1]], [[1.0, 1.0]], 3, "assign must have shape"),
        ([[0, 1]], [[1.0, 1.0]], -1, "num_targets"),
    ],
)
def test_merge_bad_inputs(assign: list, weight: list, t: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        merge_tokens(torch.zeros(1, 2, 3), torch.tensor(assign), torch.tensor(weight), t)
