"""Qwen3-VL's pre-LLM stage drops a token together with its DeepStack rows.

The reference runs transformers' own Qwen3-VL pieces by hand (vision tower, embeddings, rope index, text model
with ``visual_pos_masks`` / ``deepstack_visual_embeds``) on the kept tokens only; it shares no code with the
engine. Stages inside the LM before the DeepStack layers stay refused.
"""

from __future__ import annotations

import pytest
import torch

import vtprune
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3_vl")


def reference_logits(model, inputs: dict, kept: list[int]) -> torch.Tensor:
    """``[V]`` last-position logits of sample 0 with only the ``kept`` visual tokens (ordinals) in the LM."""
    core = model.model
    ids = inputs["input_ids"]
    embeds = core.get_input_embeddings()(ids)
    image = core.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    features = torch.cat(list(image.pooler_output))
    deepstack = [torch.cat(list(d)) if isinstance(d, list | tuple) else d for d in image.deepstack_features]
    visual = ids == model.config.image_token_id
    embeds[visual] = features.to(embeds.dtype)
    positions, _ = core.get_rope_index(ids, mm_token_type_ids=inputs.get("mm_token_type_ids"),
                                       image_grid_thw=inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])
    ordinal = visual[0].long().cumsum(0) - 1
    stay = ~visual[0] | torch.isin(ordinal, torch.tensor(kept))
    rows = torch.tensor(kept)
    out = core.language_model(inputs_embeds=embeds[:, stay], position_ids=positions[:, :, stay],
                              attention_mask=torch.ones(1, int(stay.sum()), dtype=torch.long),
                              visual_pos_masks=visual[:, stay], deepstack_visual_embeds=[d[rows] for d in deepstack])
    return model.lm_head(out.last_hidden_state)[0, -1]


@pytest.mark.parametrize("method", ["divprune", "random"])
def test_pre_llm_stage_equals_the_hand_built_reference(qwen3, method):
    model, processor = qwen3
    inputs = tiny_inputs(processor, "qwen3_vl", [("what color is the circle", [random_image(96, 64, 3)])])
    with vtprune.apply(model, method, schedule="0:0.25", logits="pruned") as handle, torch.no_grad():
        got = model(**inputs).logits[0, -1]
        kept = [int(i) for i in handle.last_stats.kept_indices[0][0]]
        assert handle.stages[0].layer == 0
    with torch.no_grad():
        want = reference_logits(model, inputs, kept)
    assert len(kept) == round(0.25 * int((inputs["input_ids"] == model.config.image_token_id).sum()))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_keep_one_at_layer_zero_equals_the_unwrapped_model(qwen3):
    model, processor = qwen3
    inputs = tiny_inputs(processor, "qwen3_vl", [("how many", [random_image(64, 64, 1)]),
                                                 ("what color is the square", [random_image(96, 64, 2)])])
    with torch.no_grad():
        want = model(**inputs).logits
        with vtprune.apply(model, "divprune", keep=1.0):
            got = model(**inputs).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_batch_equals_samples_alone(qwen3):
    model, processor = qwen3
    samples = [("how many", [random_image(64, 64, 1)]), ("what color is the square", [random_image(96, 64, 2)])]
    with vtprune.apply(model, "divprune", keep=0.3) as handle, torch.no_grad():
        batch = model.generate(**tiny_inputs(processor, "qwen3_vl", samples), max_new_tokens=3, do_sample=False)
        alone = [model.generate(**tiny_inputs(processor, "qwen3_vl", [s]), max_new_tokens=3, do_sample=False)
                 for s in samples]
        assert handle.stages[0].layer == 0
    assert [row[-3:].tolist() for row in batch] == [row[0, -3:].tolist() for row in alone]


def test_stage_inside_the_deepstack_layers_is_refused(qwen3):
    model, _ = qwen3
    with pytest.raises(ValueError, match="DeepStack features are still added"):
        vtprune.wrap(model, "fastv", keep=0.5, layer=1)
    with pytest.raises(ValueError, match="layer 1"):
        vtprune.wrap(model, "divprune", schedule="0:0.5,1:0.25")
