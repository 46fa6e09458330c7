"""``vtprune.kernels.visual_attention_scores``: hand-computed cases, the naive softmax formula, degenerate rows,
Triton (interpreter) vs the reference (key splits, scaling), and bad inputs."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_cases import DTYPES, INF, SCORE_TOL, gen, needs_interpreter  # noqa: E402
from vtprune.kernels import (  # noqa: E402
    _dispatch,
    visual_attention_scores,
    visual_attention_scores_torch,
)

torch.set_num_threads(1)


def test_scores_hand_case() -> None:
    # one head, d=1, scaling 1: logits [0, ln 3] -> softmax [1/4, 3/4]
    key = torch.tensor([0.0, math.log(3.0)]).view(1, 1, 2, 1)
    q = torch.ones(1, 1, 1, 1)

    def run(query, pos, **kw):  # noqa: ANN001, ANN202
        return visual_attention_scores_torch(query, key, torch.tensor([pos]), kw.get("kv"), kw.get("qv"), 1.0)

    assert torch.allclose(run(q, [1]), torch.tensor([[0.25, 0.75]]))
    assert torch.allclose(run(q, [0]), torch.tensor([[1.0, 0.0]]))  # causal
    assert torch.allclose(run(q, [1], kv=torch.tensor([[False, True]])), torch.tensor([[0.0, 1.0]]))
    q2 = torch.ones(1, 1, 2, 1)  # queries at positions 0 and 1: ([1, 0] + [1/4, 3/4]) / 2
    assert torch.allclose(run(q2, [0, 1]), torch.tensor([[0.625, 0.375]]))
    assert torch.allclose(run(q2, [0, 1], qv=torch.tensor([[False, True]])), torch.tensor([[0.25, 0.75]]))
    gqa = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)  # head 1 has a zero query -> uniform [1/2, 1/2]
    assert torch.allclose(run(gqa, [1]), torch.tensor([[0.375, 0.625]]))


def test_scores_matches_naive_formula() -> None:
    g = gen(2)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    pos = torch.tensor([[2, 4, 5], [0, 5, 5]])
    kv = torch.tensor([[True] * 6, [False, True, True, True, True, True]])
    qv = torch.tensor([[True, True, True], [True, False, True]])
    out = visual_attention_scores(q, k, pos, kv, qv)
    want = torch.zeros(2, 6)
    for b in range(2):
        for h in range(4):
            for i in range(3):
                vis = (torch.arange(6) <= pos[b, i]) & kv[b]
                logits = (k[b, h // 2] @ q[b, h, i]) / math.sqrt(8)
                p = torch.softmax(logits.masked_fill(~vis, -INF), 0) if vis.any() else torch.zeros(6)
                want[b] += p * qv[b, i] / (4 * qv[b].sum())
    assert torch.allclose(out, want, atol=1e-6)
    # sample 1: the valid query at position 0 sees no valid key, so it contributes a zero row
    assert torch.allclose(out.sum(1), torch.tensor([1.0, 0.5]), atol=1e-6)


def test_scores_degenerate_rows_are_zero() -> None:
    q, k = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 4, 8)
    pos = torch.tensor([[3], [3]])
    out = visual_attention_scores(q, k, pos, key_valid=torch.tensor([[False] * 4, [True] * 4]))
    assert out[0].abs().sum() == 0 and torch.allclose(out[1].sum(), torch.tensor(1.0))
    out = visual_attention_scores(q, k, pos, query_valid=torch.tensor([[False], [True]]))
    assert out[0].abs().sum() == 0


def _scores_case(bsz: int, heads: int, kv_heads: int, n_q: int, n_keys: int, dim: int, dtype: torch.dtype):  # noqa: ANN202
    g = gen(n_keys * 7 + n_q)
    q = torch.randn(bsz, heads, n_q, dim, generator=g).to(dtype)
    k = torch.randn(bsz, kv_heads, n_keys, dim, generator=g).to(dtype)
    pos = torch.randint(0, n_keys, (bsz, n_q), generator=g)
    pos[:, -1] = n_keys - 1
    key_valid = torch.rand(bsz, n_keys, generator=g) > 0.2
    query_valid = torch.rand(bsz, n_q, generator=g) > 0.3
    query_valid[:, -1] = True
    return q, k, pos, key_valid, query_valid


@needs_interpreter
@pytest.mark.parametrize(
    "shape,dtypes",
    [
        ((1, 2, 1, 1, 1, 16), DTYPES),
        ((3, 4, 2, 5, 7, 24), DTYPES),
        ((1, 4, 4, 17, 70, 64), DTYPES),
        ((3, 2, 1, 3, 577, 16), DTYPES),
    ],
)
def test_scores_triton_matches_reference(shape: tuple[int, ...], dtypes: list[torch.dtype]) -> None:
    for dtype in dtypes:
        q, k, pos, kv, qv = _scores_case(*shape, dtype=dtype)
        out = visual_attention_scores(q, k, pos, kv, qv, impl="triton")
        want = visual_attention_scores(q, k, pos, kv, qv, impl="torch")
        assert out.dtype == torch.float32 and out.shape == (shape[0], shape[4])
        torch.testing.assert_close(out, want, atol=SCORE_TOL[dtype], rtol=1e-3)


@needs_interpreter
def test_scores_triton_key_splits_and_scaling() -> None:
    from vtprune.kernels.scoring import _query_weights

    mod = _dispatch.load_triton_module("_triton_scoring")
    q, k, pos, kv, qv = _scores_case(2, 2, 1, 3, 200, 16, torch.float32)
    want = visual_attention_scores_torch(q, k, pos, kv, qv, 0.3)
    out = mod.visual_attention_scores_triton(q, k, pos, kv, _query_weights(pos, qv, 2), 0.3, num_splits=3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-3)


def test_scores_bad_inputs() -> None:
    q, k, pos = torch.zeros(1, 6, 2, 8), torch.zeros(1, 4, 5, 8), torch.tensor([[1, 4]])
    with pytest.raises(ValueError, match="H=6 .* H_kv=4"):
        visual_attention_scores(q, k, pos)
    k2 = torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"query_positions\[0, 1\]=5 is outside"):
        visual_attention_scores(q, k2, torch.tensor([[1, 5]]))
    with pytest.raises(ValueError, match="float64"):
        visual_attention_scores(q.double(), k2.double(), pos)
    with pytest.raises(ValueError, match="Q >= 1"):
        visual_attention_scores(q[:, :, :0], k2, pos[:, :0])
    with pytest.raises(ValueError, match="key_valid must have shape"):
        visual_attention_scores(q, k2, pos, key_valid=torch.ones(1, 4, dtype=torch.bool))
