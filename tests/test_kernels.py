"""Tests for vtprune.kernels: hand-computed references, Triton (interpreter) vs reference, properties, errors.

The Triton paths run through the Triton CPU interpreter: TRITON_INTERPRET=1 is set here before any Triton kernel
module is imported (``load_triton_module`` re-imports one defined without it). The interpreter costs ~1 ms per
program instance, so Triton shapes stay small (up to 577 tokens/keys, 2880 for top-k); the attention kernel's 577-key case uses few
heads/queries, and larger shapes are left to the torch paths and the GPU benchmark.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vtprune.kernels import (  # noqa: E402
    _dispatch,
    merge_tokens,
    merge_tokens_torch,
    segmented_topk,
    segmented_topk_torch,
    segmented_topk_torch_loop,
    visual_attention_scores,
    visual_attention_scores_torch,
)

torch.set_num_threads(1)
INF = float("inf")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MERGE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SCORE_TOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}  # fp32 math on the same inputs
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not _dispatch.triton_available(),
    reason="Triton paths are tested on CPU through TRITON_INTERPRET=1",
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- hand-computed references


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


def test_merge_hand_case() -> None:
    x = torch.tensor([[[1.0, 10.0], [3.0, 30.0], [5.0, 50.0], [7.0, 70.0]]])
    assign, weight = torch.tensor([[0, 0, 1, -1]]), torch.tensor([[1.0, 3.0, 1.0, 1.0]])
    want = torch.tensor([[[2.5, 25.0], [5.0, 50.0], [0.0, 0.0]]])  # (1*1+3*3)/4, 5, empty target -> 0
    assert torch.allclose(merge_tokens_torch(x, assign, weight, 3), want)
    assert torch.allclose(merge_tokens(x, assign, weight, 3), want)


def test_merge_matches_formula() -> None:
    g = _gen(1)
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
    g = _gen(2)
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


def test_topk_torch_fallbacks_agree_on_large_cpu_input() -> None:
    scores = torch.randint(0, 50, (3, 30000), generator=_gen(4)).float()  # > CPU_LOOP_NUMEL: the loop path
    lengths, k = torch.tensor([30000, 12345, 1]), torch.tensor([7000, 12345, 0])
    assert torch.equal(
        segmented_topk(scores, lengths, k, impl="torch"), segmented_topk_torch(scores, lengths, k)
    )


# ---------------------------------------------------------------- Triton (interpreter) vs reference


def _topk_case(bsz: int, n: int, seed: int, dtype: torch.dtype):  # noqa: ANN202
    g = _gen(seed)
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
    scores = torch.randn(300, 3, generator=_gen(3)).t()  # [3, 300], non-contiguous
    lengths, k = torch.tensor([300, 17, 1]), torch.tensor([150, 17, 1])
    want = segmented_topk_torch_loop(scores.contiguous(), lengths, k)
    assert torch.equal(segmented_topk(scores, lengths, k, impl="triton"), want)


@needs_interpreter
@pytest.mark.parametrize("shape", [(1, 1, 8, 1), (3, 7, 24, 3), (3, 577, 64, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_triton_matches_reference(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    bsz, n, dim, t = shape
    g = _gen(n)
    x = torch.randn(bsz, n, dim, generator=g).to(dtype)
    assign = torch.randint(-1, t, (bsz, n), generator=g)
    weight = torch.rand(bsz, n, generator=g) * (torch.rand(bsz, n, generator=g) > 0.1)  # some zero weights
    out = merge_tokens(x, assign, weight, t, impl="triton")
    want = merge_tokens_torch(x, assign, weight, t)
    assert out.dtype == dtype and out.shape == (bsz, t, dim)
    atol, rtol = MERGE_TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)


def _scores_case(bsz: int, heads: int, kv_heads: int, n_q: int, n_keys: int, dim: int, dtype: torch.dtype):  # noqa: ANN202
    g = _gen(n_keys * 7 + n_q)
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


# ---------------------------------------------------------------- top-k properties (hypothesis)

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


# ---------------------------------------------------------------- bad inputs


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


# ---------------------------------------------------------------- dispatch and import hygiene


def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.resolve_impl("auto", cpu) == "torch"
    monkeypatch.setenv(_dispatch.ENV_VAR, "torch")
    assert _dispatch.resolve_impl("auto", cpu) == "torch"
    monkeypatch.setenv(_dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="VTPRUNE_KERNEL_IMPL='fast'"):
        _dispatch.resolve_impl("auto", cpu)
    monkeypatch.delenv(_dispatch.ENV_VAR)
    with pytest.raises(ValueError, match="impl='cuda'"):
        segmented_topk(torch.zeros(1, 2), torch.tensor([2]), torch.tensor([1]), impl="cuda")
    if _dispatch.triton_available():
        with pytest.raises(ValueError, match="does not support this input dtype"):
            segmented_topk(
                torch.zeros(1, 2, dtype=torch.float64), torch.tensor([2]), torch.tensor([1]), impl="triton"
            )
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if _dispatch.triton_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            segmented_topk(torch.zeros(1, 2), torch.tensor([2]), torch.tensor([1]), impl="triton")
    monkeypatch.setattr(_dispatch, "_TRITON_CHECKED", True)
    monkeypatch.setattr(_dispatch, "_TRITON_IMPORT_ERROR", ImportError("no module named triton"))
    with pytest.raises(RuntimeError, match="pip install triton"):
        _dispatch.resolve_impl("triton", cpu)
    assert _dispatch.resolve_impl("auto", torch.device("cuda")) == "torch"  # silent fallback


def test_import_does_not_load_triton_nor_bare_kernels() -> None:
    code = (
        "import importlib.util, sys, torch\n"
        "import vtprune.kernels as K\n"
        "K.segmented_topk(torch.randn(2, 5), torch.tensor([5, 3]), torch.tensor([2, 1]))\n"
        "K.merge_tokens(torch.randn(1, 3, 2), torch.tensor([[0, 0, -1]]), torch.ones(1, 3), 1)\n"
        "K.visual_attention_scores(torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), torch.tensor([[2]]))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "assert importlib.util.find_spec('kernels') is None, 'bare kernels is importable'\n"
    )
    env = {key: val for key, val in os.environ.items() if key not in ("TRITON_INTERPRET", "PYTHONPATH")}
    res = subprocess.run([sys.executable, "-c", code], cwd="/tmp", env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


AOT_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vtprune.kernels import _triton_merge as M, _triton_scoring as S, _triton_topk as T

def compile_(fn, sig, consts, **opts):
    sig = {**sig, **{name: "constexpr" for name in consts}}
    triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)

compile_(T._segmented_topk_kernel, {"scores_ptr": "*bf16", "lengths_ptr": "*i64", "k_ptr": "*i64",
         "out_ptr": "*i64", "stride_s": "i32", "stride_out": "i32"}, {"BLOCK": 1024, "RADIX_BITS": 4}, num_warps=8)
compile_(M._merge_scatter_kernel, {"x_ptr": "*bf16", "assign_ptr": "*i64", "weight_ptr": "*fp32",
         "acc_ptr": "*fp32", "wsum_ptr": "*fp32", "N": "i32", "D": "i32", "T": "i32", "tiles_n": "i32"},
         {"BLOCK_N": 16, "BLOCK_D": 128})
compile_(M._merge_finalize_kernel, {"acc_ptr": "*fp32", "wsum_ptr": "*fp32", "out_ptr": "*bf16", "R": "i32",
         "D": "i32"}, {"BLOCK_R": 16, "BLOCK_D": 128})
base = {"q_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64", "kvalid_ptr": "*u8", "m_ptr": "*fp32",
        "l_ptr": "*fp32"}
dims = {"H": "i32", "Q": "i32", "L": "i32", "HEAD_DIM": "i32", "GROUP": "i32"}
consts = {"BLOCK_Q": 16, "BLOCK_L": 64, "BLOCK_D": 128, "UPCAST": False, "PRECISION": "tf32"}
compile_(S._stats_kernel, {**base, **dims, "SPLITS": "i32", "blocks_per_split": "i32", "qk_scale": "fp32"}, consts)
compile_(S._accumulate_kernel, {**base, "coef_ptr": "*fp32", "part_ptr": "*fp32", **dims, "qk_scale": "fp32"}, consts)
print("compiled")
"""


def test_triton_kernels_compile_for_sm90() -> None:
    """Ahead-of-time compile (no GPU needed: triton bundles ptxas) catches errors the interpreter accepts."""
    import triton.backends.nvidia  # noqa: F401  (shipped with triton; a missing backend must fail, not skip)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True)
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("this triton wheel ships no ptxas binary, so an ahead-of-time sm_90 compile is impossible here")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]
