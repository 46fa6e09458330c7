"""Qwen-VL segments from the processor's grids: a Qwen3-VL video arrives as one grid but several placeholder runs
(a timestamp is written before every frame); its runs form one segment and what follows keeps its ordinals."""

from __future__ import annotations

import torch
from vtprune.adapters import get_adapter
from vtprune.adapters.base import VisualSegment

from vtprune.models.tiny import tiny_model


def test_a_video_split_into_frame_runs_is_one_segment():
    model, _ = tiny_model("qwen3_vl")
    adapter = get_adapter(model)
    video, image, start, end = (model.config.video_token_id, model.config.image_token_id,
                                model.config.vision_start_token_id, model.config.vision_end_token_id)
    row = [1]
    for frame in range(4):  # "<t seconds><|vision_start|>" + 4 video tokens + "<|vision_end|>" per frame
        row += [20 + frame, start] + [video] * 4 + [end]
    row += [start] + [image] * 4 + [end, 2]
    inputs = {"video_grid_thw": torch.tensor([[4, 4, 4]]), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    segments = adapter.segments(torch.tensor([row]), inputs)
    assert segments == [[VisualSegment(0, 4, 2, 2, kind="video"), VisualSegment(16, 1, 2, 2, kind="image")]]
