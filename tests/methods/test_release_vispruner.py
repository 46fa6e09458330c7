"""VisPruner: the kept tokens equal the authors' release on fixed inputs, a hand-computed round of duplicate
removal, and the model path against the unwrapped tower's own attention and features."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.config import keep_count
from vtprune.methods.vispruner import important_diverse, pick_priority
from vtprune.models.tiny import tiny_inputs, tiny_model

torch.set_num_threads(1)
DATA = Path(__file__).parent.parent / "data" / "release_vispruner.pt"


@functools.cache
def _model(model_type: str, impl: str = "eager"):
    return tiny_model(model_type, impl, image_size=112)


def test_the_kept_tokens_equal_the_release():
    data = torch.load(DATA, weights_only=True)
    assert data["release"] == "Theia-4869/VisPruner" and len(data["commit"]) == 40
    for case in data["cases"]:
        kept = important_diverse(case["attention_heads"].mean(dim=0), case["features"], case["count"],
                                 case["important_ratio"])
        assert kept.tolist() == case["kept"]


def test_one_round_of_duplicate_removal_by_hand():
    # attention order 0..5; 2 important (0, 1), 2 diverse of the residual [2, 3, 4, 5]: a = [2, 4], b = [3, 5];
    # best cos to b: x2 1.0 (twin of x3), x4 0.707; r = min(8, 4 - 2) = 2 drops both a's, leaving b = [3, 5].
    att = torch.tensor([0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert important_diverse(att, feats, 4).tolist() == [0, 1, 3, 5]
    # 3 diverse of 4: r = 1 drops the most redundant a (x2, a twin of x3) and keeps x4 first.
    assert important_diverse(att, feats, 5, important_ratio=0.4).tolist() == [0, 1, 4, 3, 5]
    assert important_diverse(att, feats, 2, important_ratio=1.0).tolist() == [0, 1]
    assert important_diverse(att, feats, 9).tolist() == [0, 1, 2, 3, 4, 5]  # the count is capped at n


def test_pick_priority_puts_picks_first_in_order_then_the_rest_by_value():
    priority = pick_priority(torch.tensor([0.1, 0.9, 0.5, 0.7]), torch.tensor([2, 0]))
    assert torch.argsort(priority, descending=True).tolist() == [2, 0, 1, 3]
    assert bool((priority > 0).all()) and bool((priority < 1).all())


def _tower_maps(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """CLS attention ``[n, T]`` and features ``[n, T, D]`` of the unwrapped tower's feature layer (eager)."""
    layer = model.config.vision_feature_layer
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True, output_attentions=True)
    return out.attentions[layer].mean(dim=1)[:, 0, 1:], out.hidden_states[layer][:, 1:]


def test_llava_keeps_the_release_selection_of_the_unwrapped_towers_maps():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    attention, features = _tower_maps(model, inputs)
    with vtprune.apply(model, "vispruner", keep=0.3) as handle, torch.no_grad():
        model(**inputs)
    kept = handle.last_stats.kept_indices[0]
    tokens = attention.shape[1]
    quota = keep_count(0.3, tokens)
    expected = [sorted(important_diverse(a, f, quota).tolist()) for a, f in zip(attention, features, strict=True)]
    assert kept[0] == expected[0]
    assert kept[1] == expected[1] + [tokens + i for i in expected[2]]  # the second sample's two images


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_5_vl"])
def test_a_batch_equals_each_sample_alone(model_type):
    model, processor = _model(model_type, "sdpa")
    samples = two_samples(model_type)
    with vtprune.apply(model, "vispruner", keep=0.3) as handle, torch.no_grad():
        model(**tiny_inputs(processor, model_type, samples))
        batch = handle.last_stats.kept_indices[0]
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, model_type, [sample]))
            assert handle.last_stats.kept_indices[0] == [batch[row]]


def test_bad_options_are_refused_in_one_line():
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="important_ratio=1.5"):
        vtprune.wrap(model, "vispruner", keep=0.25, important_ratio=1.5)
    with pytest.raises(ValueError, match="vit_layer=7"):
        vtprune.wrap(model, "vispruner", keep=0.25, vit_layer=7)


def test_the_vllm_plugin_serves_it_through_the_tower_path():
    from vtprune.vllm import settings

    assert settings.VllmPruning.from_dict({"method": "vispruner", "keep": 0.25}).method == "vispruner"
    assert "vispruner" in settings.TOWER_METHODS and "vispruner" not in settings.NOT_YET


def test_parity_release_takes_the_exact_tower_map():
    model, processor = _model("qwen2_vl", "sdpa")
    inputs = tiny_inputs(processor, "qwen2_vl", two_samples("qwen2_vl"))
    kept = {}
    for parity in ("default", "release"):
        with vtprune.apply(model, "vispruner", keep=0.3, parity=parity) as handle, torch.no_grad():
            model(**inputs)
            kept[parity] = handle.last_stats.kept_indices
            assert handle.scorer.queries == ("all" if parity == "release" else "auto")
    assert kept["release"] == kept["default"]  # small images: "auto" is the exact map too
