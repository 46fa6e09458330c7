"""HiPrune: the kept tokens equal the authors' release on fixed inputs, hand-computed anchors / buffers /
registers, the default layers, and the model path against the unwrapped tower's own attention."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from cases import two_samples
from vtprune.adapters.base import VisualSegment

import vtprune
from vtprune.config import keep_count
from vtprune.methods.hiprune import (
    QWEN_OBJECT,
    anchor_count,
    group_widths,
    hierarchical_select,
    scaled_object_layer,
)
from vtprune.methods.per_frame import frame_ids
from vtprune.models.tiny import tiny_inputs, tiny_model

torch.set_num_threads(1)
DATA = Path(__file__).parent.parent / "data" / "release_hiprune.pt"


@functools.cache
def _model(model_type: str, impl: str = "eager"):
    return tiny_model(model_type, impl, image_size=112)


def test_the_kept_tokens_equal_the_release():
    data = torch.load(DATA, weights_only=True)
    assert data["release"] == "Danielement321/HiPrune" and len(data["commit"]) == 40
    assert len(data["cases"]) == 10
    for case in data["cases"]:
        kept = hierarchical_select(case["shallow"], case["deep"], case["count"], case["width"], case["alpha"])
        assert sorted(kept.tolist()) == case["kept"]


def test_anchors_buffers_and_registers_by_hand():
    # 4 x 4 grid; count 10, alpha 0.5 -> round(10 * 0.5 / 5) = 1 anchor: token 5 (row 1, col 1), crossed by
    # 1, 4, 6, 9; 5 registers: the deep top among the rest (15, 14, 13, 12, 11; 9 and 6 are already kept).
    shallow = torch.full((16,), 0.01)
    shallow[5] = 0.5
    deep = torch.arange(16, dtype=torch.float32) / 100
    assert hierarchical_select(shallow, deep, 10, 4, 0.5).tolist() == [1, 4, 5, 6, 9, 15, 14, 13, 12, 11]
    # an anchor at a row's first token: its left neighbour is the previous row's last token, as released
    shallow[4] = 0.9
    assert hierarchical_select(shallow, deep, 6, 4, 1.0 * 5 / 6).tolist() == [0, 3, 4, 5, 8, 15]
    # crosses beyond the budget keep their top by object-layer attention: 3 of the 5 around token 4
    assert hierarchical_select(shallow, deep, 3, 4, 1.0).tolist() == [0, 4, 5]
    assert hierarchical_select(shallow, deep, 4, 4, 0.0).tolist() == [15, 14, 13, 12]  # no anchors: deep top


def test_anchor_count_rounds_half_to_even_as_released():
    assert [anchor_count(c, 0.1) for c in (192, 128, 64, 320)] == [4, 3, 1, 6]
    assert anchor_count(25, 0.5) == 2 and anchor_count(35, 0.5) == 4


def test_each_video_frame_is_a_group_with_its_grid_width():
    segments = [VisualSegment(0, 1, 2, 5, kind="image"), VisualSegment(10, 3, 2, 3, kind="video")]
    assert group_widths(segments) == [5, 3, 3, 3]
    assert frame_ids(segments, 28).unique().tolist() == [0, 1, 2, 3]  # the same groups, in the same order


def test_default_object_layers_scale_the_releases():
    assert scaled_object_layer(24) == 8  # HIPRUNE_OBJECT_LAYER=9 on LLaVA's CLIP
    assert scaled_object_layer(32, [7, 15, 23, 31], QWEN_OBJECT) == 15  # =16 on Qwen2.5-VL, a full block
    assert scaled_object_layer(32, list(range(32)), QWEN_OBJECT) == 15
    assert scaled_object_layer(27) == 9 and scaled_object_layer(2) == 0
    assert scaled_object_layer(2, [1], QWEN_OBJECT) == 1


def _global_attention(model, inputs, layer: int) -> torch.Tensor:
    """Mean attention received from every query ``[n, T]`` at ``layer`` of the unwrapped tower (eager), CLS dropped."""
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True)
    return out.attentions[layer].mean(dim=1).mean(dim=1)[:, 1:]


def test_llava_keeps_the_release_selection_of_the_unwrapped_towers_maps():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    shallow = _global_attention(model, inputs, 1)
    deep = _global_attention(model, inputs, model.config.vision_feature_layer)
    with vtprune.apply(model, "hiprune", keep=0.5, object_layer=1, alpha=0.5) as handle, torch.no_grad():
        model(**inputs)
    kept = handle.last_stats.kept_indices[0]
    tokens = shallow.shape[1]
    width = int(tokens ** 0.5)
    quota = keep_count(0.5, tokens)
    expected = [sorted(hierarchical_select(s, d, quota, width, 0.5).tolist()) for s, d in zip(shallow, deep, strict=True)]
    assert kept[0] == expected[0]
    assert kept[1] == expected[1] + [tokens + i for i in expected[2]]


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_5_vl"])
def test_a_batch_equals_each_sample_alone(model_type):
    model, processor = _model(model_type, "sdpa")
    samples = two_samples(model_type)
    with vtprune.apply(model, "hiprune", keep=0.3, alpha=0.5) as handle, torch.no_grad():
        model(**tiny_inputs(processor, model_type, samples))
        batch = handle.last_stats.kept_indices[0]
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, model_type, [sample]))
            assert handle.last_stats.kept_indices[0] == [batch[row]]


def test_bad_options_are_refused_in_one_line():
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="alpha=2"):
        vtprune.wrap(model, "hiprune", keep=0.25, alpha=2)
    with pytest.raises(ValueError, match="object_layer=9 is outside"):
        vtprune.wrap(model, "hiprune", keep=0.25, object_layer=9)
    qwen25, _ = _model("qwen2_5_vl", "sdpa")
    with pytest.raises(ValueError, match="full-attention block"):
        vtprune.wrap(qwen25, "hiprune", keep=0.25, object_layer=0)


def test_the_vllm_plugin_serves_it_through_the_tower_path():
    from vtprune.vllm import settings

    assert settings.VllmPruning.from_dict({"method": "hiprune", "keep": 0.25}).method == "hiprune"
    assert "hiprune" in settings.TOWER_METHODS and "hiprune" not in settings.NOT_YET


def test_parity_release_takes_the_exact_tower_map():
    model, processor = _model("qwen2_vl", "sdpa")
    inputs = tiny_inputs(processor, "qwen2_vl", two_samples("qwen2_vl"))
    kept = {}
    for parity in ("default", "release"):
        with vtprune.apply(model, "hiprune", keep=0.3, parity=parity) as handle, torch.no_grad():
            model(**inputs)
            kept[parity] = handle.last_stats.kept_indices
            assert handle.scorer.queries == ("all" if parity == "release" else "auto")
    assert kept["release"] == kept["default"]  # small images: "auto" is the exact map too
