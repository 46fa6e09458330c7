"""Fused kernels for visual-token pruning: segmented top-k, weighted token merge, attention-received scores.

Each kernel has a pure-PyTorch reference (``*_torch``, also the runtime fallback) and a Triton implementation.
``impl="auto"`` (default) uses Triton for CUDA tensors when ``triton`` imports and torch otherwise;
``$VTPRUNE_KERNEL_IMPL`` (``auto``/``triton``/``torch``) replaces ``"auto"``. Triton is imported only when a
Triton path runs, so importing this package needs neither triton nor a GPU. Always import it as
``vtprune.kernels`` (never as a bare ``kernels``).
"""

from ._dispatch import ENV_VAR, IMPLS, check_environment, resolve_impl, triton_available
from .merge import merge_tokens, merge_tokens_torch
from .scoring import visual_attention_scores, visual_attention_scores_torch
from .topk import segmented_topk, segmented_topk_torch, segmented_topk_torch_loop

__all__ = [
    "ENV_VAR",
    "IMPLS",
    "check_environment",
    "merge_tokens",
    "merge_tokens_torch",
    "resolve_impl",
    "segmented_topk",
    "segmented_topk_torch",
    "segmented_topk_torch_loop",
    "triton_available",
    "visual_attention_scores",
    "visual_attention_scores_torch",
]
