"""``vtprune.kernels.segmented_topk``: hand-computed cases, the torch fallbacks, Triton (interpreter) vs
the reference, properties (hypothesis) and bad inputs. Shared cases and tolerances: ``kernel_cases.py``."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_cases import DTYPES, INF, gen, needs_interpreter  # noqa: E402
from vtprune.kernels import (  # noqa: E402
    segmented_topk,
    segmented_topk_torch,
    segmented_topk_torch_loop,
)

torch.set_num_threads(1)


def test_topk_hand_case() -> None:
    nan = float("nan")
    scores = torch.tensor(
        [[0.1, 0.9, 0.5, 0.9, -INF, 7.0], [INF, INF, 2.0, nan, nan, nan], [-0.0, 0.0, -1.0, 0.0, 3.0, 3.0]]
    )
    lengths, k = torch.tensor([5, 3, 4]), torch.tensor([3, 1, 2])
    want = torch.tensor([[1, 2, 3], [0, -1, -1], [0, 1, -1]])  # ties (0.9, +inf, -0.0 == 0.0) -> lower index
    for fn in (segmented_topk_torch_loop, segmented_topk_torch, segmented_topk):
        assert torch.equal(fn(scores, lengths, k), want), fn.__name__


def test_topk_inf_order_and_empty() -> None:
    scores = torch.tensor([[-INF, 1.0, INF, -INF]])
    assert segmented_topk(scores, torch.tensor([4]), torch.tensor([3])).tolist() == [[0, 1, 2]]
    out = segmented_topk(scores.expand(2, 4), torch.tensor([4, 2]), torch.tensor([0, 0]))
    assert out.shape == (2, 0) and out.dtype == torch.long


def test_topk_torch_fallbacks_agree_on_large_cpu_input() -> None:
    scores = torch.randint(0, 50, (3, 30000), generator=gen(4)).float()  # > CPU_LOOP_NUMEL: the loop path
    lengths, k = torch.tensor([30000, 12345, 1]), torch.tensor([7000, 12345, 0])
    assert torch.equal(
        segmented_topk(scores, lengths, k, impl="torch"), segmented_topk_torch(scores, lengths, k)
    )


def _topk_case(bsz: int, n: int, seed: int, dtype: torch.dtype):  # noqa: ANN202
    g = gen(seed)
    scores = torch.randint(-3, 4, (bsz, n), generator=g).to(dtype)  # many ties
    if n > 2:
        scores[0, 1], scores[-1, 2] = INF, -INF
    lengths = torch.randint(1, n + 1, (bsz,), generator=g)
    lengths[0] = n
    k = (torch.rand(bsz, generator=g) * (lengths + 1)).long().clamp(max=lengths)
    k[0] = max(1, int(k[0]))
    return scores, lengths, k


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (3, 577), (1, 2880)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_triton_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    scores, lengths, k = _topk_case(*shape, seed=shape[1], dtype=dtype)
    want = segmented_topk_torch_loop(scores, lengths, k)
    assert torch.equal(segmented_topk(scores, lengths, k, impl="triton"), want)
    assert torch.equal(segmented_topk_torch(scores, lengths, k), want)


@needs_interpreter
def test_topk_triton_noncontiguous_and_continuous_scores() -> None:
    scores = torch.randn(300, 3, generator=gen(3)).t()  # [3, 300], non-contiguous
    lengths, k = torch.tensor([300, 17, 1]), torch.tensor([150, 17, 1])
    want = segmented_topk_torch_loop(scores.contiguous(), lengths, k)
    assert torch.equal(segmented_topk(scores, lengths, k, impl="triton"), want)


VALUES = st.sampled_from([-INF, -2.0, -0.0, 0.0, 0.5, 1.0, 3.0, INF])


@st.composite
def topk_inputs(draw):  # noqa: ANN001, ANN201
    bsz, n = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    scores = torch.tensor([[draw(VALUES) for _ in range(n)] for _ in range(bsz)])
    lengths = torch.tensor([draw(st.integers(0, n)) for _ in range(bsz)])
    k = torch.tensor([draw(st.integers(0, int(m))) for m in lengths])
    return scores, lengths, k


def _check_invariants(
    out: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor
) -> None:
    assert out.shape == (scores.shape[0], int(k.max()))
    for b in range(scores.shape[0]):
        kb, nb = int(k[b]), int(lengths[b])
        sel, pad = out[b, :kb], out[b, kb:]
        assert (pad == -1).all() and (sel >= 0).all() and (sel < nb).all()
        assert (sel[1:] > sel[:-1]).all()  # ascending, distinct
        span = scores[b, :nb]
        chosen = torch.zeros(nb, dtype=torch.bool)
        chosen[sel] = True
        if kb and kb < nb:
            lo, hi = span[chosen].min(), span[~chosen].max()
            assert lo >= hi
            # ties at the threshold go to the lower positions
            tied = (span == lo).nonzero().flatten()
            assert chosen[tied].tolist() == sorted(chosen[tied].tolist(), reverse=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topk_inputs())
def test_topk_properties_torch(case) -> None:  # noqa: ANN001
    scores, lengths, k = case
    out = segmented_topk(scores, lengths, k, impl="torch")
    _check_invariants(out, scores, lengths, k)
    assert torch.equal(out, segmented_topk_torch_loop(scores, lengths, k))


@needs_interpreter
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topk_inputs())
def test_topk_properties_triton(case) -> None:  # noqa: ANN001
    scores, lengths, k = case
    out = segmented_topk(scores, lengths, k, impl="triton")
    _check_invariants(out, scores, lengths, k)
    assert torch.equal(out, segmented_topk_torch_loop(scores, lengths, k))


@pytest.mark.parametrize(
    "lengths,k,match",
    [
        ([3, 2], [4, 1], r"k\[0\]=4 exceeds lengths\[0\]=3"),
        ([3, 2], [1, -1], r"k\[1\]=-1 is negative"),
        ([6, 2], [1, 1], r"lengths\[0\]=6 exceeds N=5"),
        ([3], [1], r"shape \[B\]=\[2\]"),
    ],
)
def test_topk_bad_inputs(lengths: list[int], k: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        segmented_topk(torch.zeros(2, 5), torch.tensor(lengths), torch.tensor(k))


def test_topk_nan_names_sample() -> None:
    scores = torch.zeros(3, 4)
    scores[1, 3] = float("nan")
    segmented_topk(scores, torch.tensor([4, 3, 4]), torch.tensor([1, 1, 1]))  # NaN in padding: fine
    with pytest.raises(ValueError, match="sample 1"):
        segmented_topk(scores, torch.tensor([4, 4, 4]), torch.tensor([1, 1, 1]))
