"""Tensor-parallel agreement: every rank keeps rank 0's rows (a module of its own so tests can switch it off)."""

from __future__ import annotations

import torch


def broadcast_from_first_rank(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` of tensor-parallel rank 0 on every rank (unchanged without tensor parallelism)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        if get_tensor_model_parallel_world_size() <= 1:
            return rows
    except (ImportError, AssertionError):
        return rows
    return get_tp_group().broadcast(rows.contiguous(), src=0)
