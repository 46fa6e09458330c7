"""The M-RoPE position fill of the plugin where vLLM's own EVS helper fails (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from vtprune.vllm.positions import fill_chunk, prompt_positions

VISION_START, IMAGE, VISION_END, TEXT = 7, 9, 8, 20


def prompt():
    """text, <|vision_start|>, 4 kept placeholders of a 2x4 grid, <|vision_end|>, text."""
    ids = torch.tensor([TEXT, TEXT, VISION_START] + [IMAGE] * 4 + [VISION_END, TEXT, TEXT])
    offsets = torch.tensor([[0, 0, 1], [0, 0, 3], [0, 1, 0], [0, 1, 2]])
    return ids, offsets


def test_vllm_evs_helper_fails_where_a_chunk_ends_after_vision_start():
    from vllm.multimodal.video_prune.evs import recompute_mrope_positions

    ids, offsets = prompt()
    positions, _ = prompt_positions(len(ids), [(3, 4, 4)])
    evs_rows = torch.cat([offsets, torch.full((4, 1), 4)], dim=1).T  # [t, h, w, max width]
    with pytest.raises(IndexError):
        recompute_mrope_positions(ids, [evs_rows], positions, 3, VISION_START, IMAGE, -1)


def test_plugin_fills_that_chunk():
    ids, offsets = prompt()
    positions, delta = prompt_positions(len(ids), [(3, 4, 4)])
    media = ids == IMAGE
    filled = fill_chunk(positions, media, [offsets], 3)
    assert filled[:, 3:7].T.tolist() == [[3, 3, 4], [3, 3, 6], [3, 4, 3], [3, 4, 5]]
    assert filled[0, 7:].tolist() == [7, 8, 9]  # text continues after the unpruned extent (3 + 4)
    assert delta == 10 - 10
