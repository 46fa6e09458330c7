"""Text-conditioned selections (CDPruner, MMTok) read each request's own instruction: the LM-input embeddings of
its text after its last visual token, per sample. Checked against the model's own embedding table, and a batch
of different questions against each sample alone (the releases share one question and normalise over a batch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch

import vtprune
from vtprune.config import Stage
from vtprune.methods import lm_inputs
from vtprune.methods.base import Scorer
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model
from vtprune.scoring import ScoreContext

torch.set_num_threads(1)
TEXT_METHODS = [name for name in ("cdpruner", "mmtok") if name in vtprune.list_methods()]
QUESTIONS = ("what color is the circle?", "how many squares are there in the picture?")


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


@dataclass(frozen=True)
class Recorder(Scorer):
    """Scores every token alike and records what :func:`lm_inputs.instruction_embeddings` gives."""

    name: ClassVar[str] = "instruction_recorder"
    layer: int = 0
    seen: list = field(default_factory=list, compare=False)

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return (Stage(self.layer, keep),)

    def captures(self, adapter, stages):
        return (lm_inputs.lm_input_capture(adapter),) if self.layer > 0 else ()

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        self.seen.append(lm_inputs.instruction_embeddings(ctx))
        return torch.zeros(ctx.valid.shape)


def _expected(model, inputs: dict) -> list[torch.Tensor]:
    """Per sample ``[Q, D]``: the embedding table's rows of the valid tokens after the last image token."""
    ids, valid = inputs["input_ids"], inputs["attention_mask"].bool()
    image = torch.zeros_like(valid)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(model.config, name, None)
        if value is not None:
            image |= ids == value
    table = model.get_input_embeddings().weight
    out = []
    for row in range(ids.shape[0]):
        last = int(image[row].nonzero().max())
        positions = [p for p in range(last + 1, ids.shape[1]) if valid[row, p]]
        out.append(table[ids[row, positions]])
    return out


@pytest.mark.parametrize(("model_type", "layer"), [("llava", 0), ("qwen2_vl", 0), ("qwen3_vl", 2)])
def test_instruction_embeddings_are_each_samples_own_question_tokens(model_type, layer):
    model, processor = _model(model_type)
    inputs = tiny_inputs(processor, model_type, [(QUESTIONS[0], [random_image(64, 64, 1)]),
                                                 (QUESTIONS[1], [random_image(80, 64, 2)])])
    recorder = Recorder(layer=layer)
    with torch.no_grad(), vtprune.apply(model, recorder, keep=0.5):
        model(**inputs)
    values, mask = recorder.seen[0]
    for row, expected in enumerate(_expected(model, inputs)):
        torch.testing.assert_close(values[row][mask[row]], expected)
    assert mask.sum(dim=1).tolist()[0] < mask.sum(dim=1).tolist()[1]  # the longer question has more tokens


def _kept(model, inputs: dict, method: str, **options) -> list:
    with torch.no_grad(), vtprune.apply(model, method, keep=0.4, **options) as handle:
        model(**inputs)
        return [stage for stage in handle.last_stats.kept_indices]


@pytest.mark.parametrize("method", TEXT_METHODS)
@pytest.mark.parametrize(("model_type", "options"), [("llava", {}), ("llava_next", {}), ("qwen2_5_vl", {}),
                                                     ("qwen3_vl", {"schedule": "2:0.4"})])
def test_a_batch_of_different_questions_equals_each_sample_alone(method, model_type, options):
    model, processor = _model(model_type)
    image = random_image(96, 80, 5)
    samples = [(QUESTIONS[0], [image]), (QUESTIONS[1], [image])]
    batch = _kept(model, tiny_inputs(processor, model_type, samples), method, **options)
    for row, sample in enumerate(samples):
        alone = _kept(model, tiny_inputs(processor, model_type, [sample]), method, **options)
        assert alone == [stage[row:row + 1] for stage in batch]


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_the_question_changes_the_selection_of_the_same_image(method):
    model, processor = _model("llava")
    image = random_image(96, 80, 5)
    kept = [_kept(model, tiny_inputs(processor, "llava", [(question, [image])]), method)[0][0]
            for question in ("red circle", "square square square blue", "how many?", "where is it?")]
    assert len({tuple(k) for k in kept}) > 1


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_vllm_serve_refuses_text_conditioned_methods_at_start_up_in_one_line(cli, method):
    code, _, err = cli("serve", "--method", method)
    assert code == 2 and f"{method!r} is not available in the vLLM plugin" in err and "instruction" in err
    assert err.count("\n") == 1


def test_cdpruner_relevance_weight_is_checked_at_wrap_time():
    assert vtprune.methods.resolve("cdpruner", {"relevance_weight": 0.5}).relevance_weight == 0.5
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="relevance_weight=.*theta in \\[0, 1\\)"):
            vtprune.methods.resolve("cdpruner", {"relevance_weight": bad})


def _instruction_ids(model, inputs: dict) -> torch.Tensor:
    ids = inputs["input_ids"][0]
    image = ids == (getattr(model.config, "image_token_id", None) or model.config.image_token_index)
    return ids[int(image.nonzero().max()) + 1:]


@pytest.mark.skipif("mmtok" not in TEXT_METHODS, reason="mmtok not registered")
@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_mmtok_selects_what_the_release_rule_gives_on_independently_computed_inputs(model_type):
    """LLaVA: ``v`` = the tower's feature-layer patches (CLS dropped), ``x`` = the projector's output of them;
    Qwen2.5-VL: ``v`` = the blocks' output averaged per 4 merger rows in window order, then put back in token
    order (the release's ``img_features``), ``x`` = the merger's output; ``z`` = the embedding table's rows of the
    instruction's ids. The pure rule on these equals what the wrapped model keeps."""
    from vtprune.config import keep_count
    from vtprune.methods.mmtok import select

    model, processor = _model(model_type)
    inputs = tiny_inputs(processor, model_type, [(QUESTIONS[1], [random_image(96, 80, 5)])])
    with torch.no_grad():
        text = model.get_input_embeddings()(_instruction_ids(model, inputs))
        if model_type == "llava":
            states = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states
            tower = states[model.config.vision_feature_layer][0, 1:]
            image = model.model.multi_modal_projector(tower)
            temperature = 0.02
        else:
            from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

            visual, grid = model.model.visual, inputs["image_grid_thw"]
            out = visual(inputs["pixel_values"], grid_thw=grid)
            window, _ = qwen.get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                                     window_size=visual.window_size, patch_size=visual.patch_size)
            hidden = out.last_hidden_state
            tower = hidden.reshape(-1, 4, hidden.shape[-1]).mean(dim=1)[torch.argsort(window)]
            image, temperature = out.pooler_output, 0.01
    expected = select(text, image, tower, keep_count(0.4, image.shape[0]), 0.5, temperature, 0.2).tolist()
    assert _kept(model, inputs, "mmtok")[0][0] == expected


@pytest.mark.skipif("mmtok" not in TEXT_METHODS, reason="mmtok not registered")
def test_mmtok_options_are_checked_and_the_lm_space_runs_batched():
    for options, match in (({"alpha": 0}, "alpha=0"), ({"tv_temperature": -1.0}, "tv_temperature=-1.0"),
                           ({"vv_temperature": True}, "vv_temperature=True"), ({"vision_space": "clip"}, "'tower'")):
        with pytest.raises(ValueError, match=match):
            vtprune.methods.resolve("mmtok", options)
    model, processor = _model("llava_onevision")
    samples = [(QUESTIONS[0], [random_image(96, 80, 5)]), (QUESTIONS[1], [random_image(64, 96, 6)])]
    batch = _kept(model, tiny_inputs(processor, "llava_onevision", samples), "mmtok", vision_space="lm")
    for row, sample in enumerate(samples):
        alone = _kept(model, tiny_inputs(processor, "llava_onevision", [sample]), "mmtok", vision_space="lm")
        assert alone == [stage[row:row + 1] for stage in batch]
