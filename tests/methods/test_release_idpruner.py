"""IDPruner: the kept tokens equal AngelSlim's release on fixed inputs, a hand-computed MMR, a Vision Selector
folder loaded as the release loads it, and the model path against the unwrapped model's own embeddings."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.config import keep_count
from vtprune.methods.idpruner import mmr_order
from vtprune.models.tiny import tiny_inputs, tiny_model

torch.set_num_threads(1)
DATA = Path(__file__).parent.parent / "data" / "release_idpruner.pt"


@functools.cache
def _model(model_type: str, impl: str = "eager"):
    return tiny_model(model_type, impl, image_size=112)


def test_the_kept_tokens_equal_the_release():
    data = torch.load(DATA, weights_only=True)
    assert data["release"] == "Tencent/AngelSlim" and len(data["commit"]) == 40
    assert len(data["cases"]) == 8
    for case in data["cases"]:
        kept = mmr_order(case["scores"], case["features"], case["count"], case["mmr_lambda"], case["parallel_k"])
        assert sorted(kept.tolist()) == case["kept"]


def test_mmr_by_hand():
    # x0 = (1, 0), x1 = (0.96, 0.28) close to x0, x2 = (0, 1); importance 1.0, 0.9, 0.2 (scores 10, 9.2, 3.6).
    feats = torch.tensor([[1.0, 0.0], [0.96, 0.28], [0.0, 1.0]])
    scores = torch.tensor([10.0, 9.2, 3.6])
    # first: x0 (most important); then 0.5 I - 0.5 max S: x1 0.45 - 0.48 < x2 0.1 - 0 -> x2, then x1
    assert mmr_order(scores, feats, 3).tolist() == [0, 2, 1]
    assert mmr_order(scores, feats, 3, mmr_lambda=1.0).tolist() == [0, 1, 2]  # importance only
    assert mmr_order(scores, feats, 2, parallel_k=2).tolist() == [0, 1]  # one step of two: the top two
    assert mmr_order(scores, feats, 9).numel() == 3


SELECTOR_PY = '''
import torch


class NormScorer(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)

    def forward(self, vision_hidden):
        return self.proj(vision_hidden).squeeze(-1)
'''


def _selector_folder(tmp_path: Path, hidden: int) -> tuple[Path, torch.nn.Linear]:
    """A Vision Selector folder in AngelSlim's layout: a linear scorer, its weights under a training prefix."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    linear = torch.nn.Linear(hidden, 1)
    (tmp_path / "scorer.py").write_text(SELECTOR_PY)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "NormScorer", "hidden_size": hidden}))
    save_file({f"module.proj.{k}": v.contiguous() for k, v in linear.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    return tmp_path, linear


def _llava_embeddings(model, inputs) -> torch.Tensor:
    """LLM-input embeddings of each image ``[n, T, D]``: the projector over the feature layer (default strategy)."""
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True)
        return model.model.multi_modal_projector(out.hidden_states[model.config.vision_feature_layer][:, 1:])


def test_a_selector_folder_scores_as_the_release_loads_it(tmp_path):
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    embeddings = _llava_embeddings(model, inputs)
    folder, linear = _selector_folder(tmp_path, embeddings.shape[-1])
    with vtprune.apply(model, "idpruner", keep=0.3, selector=str(folder)) as handle, torch.no_grad():
        model(**inputs)
    kept = handle.last_stats.kept_indices[0]
    tokens = embeddings.shape[1]
    quota = keep_count(0.3, tokens)
    with torch.no_grad():
        scores = linear(embeddings).squeeze(-1)
    expected = [sorted(mmr_order(s, e, quota).tolist()) for s, e in zip(scores, embeddings, strict=True)]
    assert kept[0] == expected[0]
    assert kept[1] == expected[1] + [tokens + i for i in expected[2]]


def test_without_a_selector_importance_is_the_towers_cls_attention():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    embeddings = _llava_embeddings(model, inputs)
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True)
    attention = out.attentions[model.config.vision_feature_layer].mean(dim=1)[:, 0, 1:]
    with vtprune.apply(model, "idpruner", keep=0.3) as handle, torch.no_grad():
        model(**inputs)
    kept = handle.last_stats.kept_indices[0]
    tokens = embeddings.shape[1]
    expected = [sorted(mmr_order(a, e, keep_count(0.3, tokens)).tolist()) for a, e in zip(attention, embeddings,
                                                                                          strict=True)]
    assert kept[0] == expected[0]
    assert kept[1] == expected[1] + [tokens + i for i in expected[2]]


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_5_vl"])
def test_a_batch_equals_each_sample_alone(model_type):
    model, processor = _model(model_type, "sdpa")
    samples = two_samples(model_type)
    with vtprune.apply(model, "idpruner", keep=0.3) as handle, torch.no_grad():
        model(**tiny_inputs(processor, model_type, samples))
        batch = handle.last_stats.kept_indices[0]
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, model_type, [sample]))
            assert handle.last_stats.kept_indices[0] == [batch[row]]


def _norm_selector(vision_hidden: torch.Tensor) -> torch.Tensor:
    """A selector callable: each token's embedding norm ``[1, N, D] -> [1, N]``."""
    return vision_hidden.norm(dim=-1)


def test_a_selector_callable_scores_each_sample_alone():
    model, processor = _model("qwen2_5_vl", "sdpa")
    samples = two_samples("qwen2_5_vl")
    with vtprune.apply(model, "idpruner", keep=0.3, selector=_norm_selector) as handle, torch.no_grad():
        model(**tiny_inputs(processor, "qwen2_5_vl", samples))
        batch = handle.last_stats.kept_indices[0]
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, "qwen2_5_vl", [sample]))
            assert handle.last_stats.kept_indices[0] == [batch[row]]
    with vtprune.apply(model, "idpruner", keep=0.3) as handle, torch.no_grad():
        model(**tiny_inputs(processor, "qwen2_5_vl", samples))
        assert handle.last_stats.kept_indices[0] != batch  # the selector's scores, not the tower's attention


def test_bad_options_are_refused_in_one_line(tmp_path):
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="mmr_lambda=2"):
        vtprune.wrap(model, "idpruner", keep=0.25, mmr_lambda=2)
    with pytest.raises(ValueError, match="parallel_k=0"):
        vtprune.wrap(model, "idpruner", keep=0.25, parallel_k=0)
    with pytest.raises(ValueError, match="importance='selector' needs selector="):
        vtprune.wrap(model, "idpruner", keep=0.25, importance="selector")
    with pytest.raises(ValueError, match="config.json") as error:
        vtprune.wrap(model, "idpruner", keep=0.25, selector=str(tmp_path))
    assert "\n" not in str(error.value)


def test_the_vllm_plugin_refuses_it_at_start_up_in_one_line():
    from vtprune.vllm import settings

    with pytest.raises(ValueError, match="idpruner.*not available in the vLLM plugin") as error:
        settings.VllmPruning.from_dict({"method": "idpruner", "keep": 0.25})
    assert "\n" not in str(error.value)


def test_parity_release_needs_the_selector(tmp_path):
    model, processor = _model("llava")
    with pytest.raises(ValueError, match="parity='release' for 'idpruner'.*needs selector=") as error:
        vtprune.wrap(model, "idpruner", keep=0.25, parity="release")
    assert "\n" not in str(error.value)
    inputs = tiny_inputs(processor, "llava", two_samples("llava"))
    folder, _ = _selector_folder(tmp_path, _llava_embeddings(model, inputs).shape[-1])
    kept = {}
    for parity in ("default", "release"):
        with vtprune.apply(model, "idpruner", keep=0.3, selector=str(folder), parity=parity) as handle, \
                torch.no_grad():
            model(**inputs)
            kept[parity] = handle.last_stats.kept_indices
    assert kept["release"] == kept["default"]  # with a selector the default is the release's rule
