"""``vtprune.kernels`` as a whole: the torch / Triton dispatch rules, import hygiene (no triton, no bare
``kernels``) and an ahead-of-time sm_90 compile of every Triton kernel. Each kernel's own tests:
``test_kernels_topk.py``, ``test_kernels_merge.py``, ``test_kernels_scores.py``."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from vtprune.kernels import (  # noqa: E402
    _dispatch,
    segmented_topk,
)


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
