"""SCOPE: the kept tokens equal the authors' release on fixed inputs, a hand-computed greedy, and the model path
against the unwrapped tower's own attention and features."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.config import keep_count
from vtprune.methods.scope import saliency_coverage_order
from vtprune.models.tiny import tiny_inputs, tiny_model

torch.set_num_threads(1)
DATA = Path(__file__).parent.parent / "data" / "release_scope.pt"


@functools.cache
def _model(model_type: str, impl: str = "eager"):
    return tiny_model(model_type, impl, image_size=112)


def test_the_kept_tokens_equal_the_release():
    data = torch.load(DATA, weights_only=True)
    assert data["release"] == "kinredon/SCOPE" and len(data["commit"]) == 40
    assert len(data["cases"]) == 8
    for case in data["cases"]:
        kept = saliency_coverage_order(case["attention_heads"].mean(dim=0), case["features"], case["count"],
                                       case["alpha"])
        assert kept.tolist() == case["kept"]  # the same tokens in the same pick order


def test_the_greedy_by_hand():
    # x0 = (1, 0), x1 its twin, x2 = (0, 1), x3 = (1, 1) / sqrt 2: s03 = s13 = s23 = 0.707.
    feats = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # step 1, nothing covered: gains 2.707 x 0.5, 2.707 x 0.1, 1.707 x 0.3, 3.121 x 0.1 -> x0; then x2 (it alone
    # adds 1 x 0.3 over x3's 1.0 x 0.1), then x3 (0.293 x 0.1), then the twin x1, which adds nothing.
    saliency = torch.tensor([0.5, 0.1, 0.3, 0.1])
    assert saliency_coverage_order(saliency, feats, 4).tolist() == [0, 2, 3, 1]
    assert saliency_coverage_order(saliency, feats, 2).tolist() == [0, 2]
    assert saliency_coverage_order(saliency, feats, 1, alpha=0.0).tolist() == [3]  # pure coverage: the centre
    assert saliency_coverage_order(saliency, feats, 9).numel() == 4  # the count is capped at n


def _tower_maps(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """CLS attention ``[n, T]`` and features ``[n, T, D]`` of the unwrapped tower's feature layer (eager)."""
    layer = model.config.vision_feature_layer
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True, output_attentions=True)
    return out.attentions[layer].mean(dim=1)[:, 0, 1:], out.hidden_states[layer][:, 1:]


@pytest.mark.parametrize("features", ["auto", "lm"])
def test_llava_keeps_the_release_selection_of_the_unwrapped_towers_maps(features):
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    attention, feats = _tower_maps(model, inputs)
    if features == "lm":  # AngelSlim's rule: the projector's output, the LLM-input embeddings
        with torch.no_grad():
            feats = model.model.multi_modal_projector(feats)
    with vtprune.apply(model, "scope", keep=0.3, features=features) as handle, torch.no_grad():
        model(**inputs)
    kept = handle.last_stats.kept_indices[0]
    tokens = attention.shape[1]
    quota = keep_count(0.3, tokens)
    expected = [sorted(saliency_coverage_order(a, f, quota).tolist()) for a, f in zip(attention, feats, strict=True)]
    assert kept[0] == expected[0]
    assert kept[1] == expected[1] + [tokens + i for i in expected[2]]  # the second sample's two images


@pytest.mark.parametrize(("model_type", "features"), [("llava_next", "auto"), ("llava_next", "lm"),
                                                     ("llava_onevision", "auto"), ("qwen2_5_vl", "auto")])
def test_a_batch_equals_each_sample_alone(model_type, features):
    model, processor = _model(model_type, "sdpa")
    samples = two_samples(model_type)
    with vtprune.apply(model, "scope", keep=0.3, features=features) as handle, torch.no_grad():
        model(**tiny_inputs(processor, model_type, samples))
        batch = handle.last_stats.kept_indices[0]
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, model_type, [sample]))
            assert handle.last_stats.kept_indices[0] == [batch[row]]


def test_bad_options_are_refused_in_one_line():
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="alpha=-1"):
        vtprune.wrap(model, "scope", keep=0.25, alpha=-1)
    with pytest.raises(ValueError, match="features='tower'"):
        vtprune.wrap(model, "scope", keep=0.25, features="tower")
    with pytest.raises(ValueError, match="vit_layer=7"):
        vtprune.wrap(model, "scope", keep=0.25, vit_layer=7)


def test_the_vllm_plugin_serves_it_through_the_tower_path():
    from vtprune.vllm import settings

    assert settings.VllmPruning.from_dict({"method": "scope", "keep": 0.25}).method == "scope"
    assert "scope" in settings.TOWER_METHODS and "scope" not in settings.NOT_YET


def test_parity_release_takes_the_exact_tower_map():
    model, processor = _model("qwen2_vl", "sdpa")
    inputs = tiny_inputs(processor, "qwen2_vl", two_samples("qwen2_vl"))
    kept = {}
    for parity in ("default", "release"):
        with vtprune.apply(model, "scope", keep=0.3, parity=parity) as handle, torch.no_grad():
            model(**inputs)
            kept[parity] = handle.last_stats.kept_indices
            assert handle.scorer.queries == ("all" if parity == "release" else "auto")
    assert kept["release"] == kept["default"]  # small images: "auto" is the exact map too
