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
TEXT_METHODS = ["cdpruner", "mmtok"]
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


def _tiny_clip(folder, vision_config) -> None:
    """A random CLIP checkpoint (character vocabulary, 8-token context) whose vision side matches ``vision_config``."""
    import json
    import string

    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + "?.,!:'")
    vocab = {token: i for i, token in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>",
                                                                                     "<|endoftext|>"])}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder)
    text = {"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "max_position_embeddings": 8, "eos_token_id": vocab["<|endoftext|>"],
            "bos_token_id": vocab["<|startoftext|>"], "pad_token_id": 0}
    torch.manual_seed(11)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision_config.to_dict(), projection_dim=16)).save_pretrained(folder)


def test_cdpruner_text_tower_uses_clip_relevance_as_the_release(tmp_path):
    """``text_tower``: ``e`` = CLIP's projected feature-layer patches, ``t`` = its text tower on the instruction
    read back as text, in 8-token segments (here), ``-cos``: the pure rule on inputs computed here from the
    unwrapped towers equals what the wrapped model keeps; a batch equals each sample alone; Qwen-VL refused."""
    from transformers import AutoTokenizer, CLIPModel

    from vtprune.config import keep_count
    from vtprune.methods.cdpruner import select

    model, processor = tiny_model("llava", "sdpa", image_size=112)
    (tmp_path / "clip").mkdir()
    _tiny_clip(tmp_path / "clip", model.config.vision_config)
    processor.tokenizer.save_pretrained(tmp_path / "vlm")
    model.name_or_path = str(tmp_path / "vlm")
    clip, clip_tokenizer = CLIPModel.from_pretrained(tmp_path / "clip"), AutoTokenizer.from_pretrained(tmp_path / "clip")
    samples = [(QUESTIONS[0], [random_image(96, 80, 5)]), (QUESTIONS[1], [random_image(64, 96, 6)])]
    batch = _kept(model, tiny_inputs(processor, "llava", samples), "cdpruner", text_tower=str(tmp_path / "clip"))
    for row, sample in enumerate(samples):
        inputs = tiny_inputs(processor, "llava", [sample])
        with torch.no_grad():
            text = processor.tokenizer.decode(_instruction_ids(model, inputs), skip_special_tokens=True).strip()
            ids = clip_tokenizer([text], return_tensors="pt")["input_ids"]
            pad = -ids.shape[1] % 8
            segments = torch.cat([ids, ids.new_zeros(1, pad)], dim=1).reshape(-1, 8)
            mask = torch.cat([torch.ones_like(ids), ids.new_zeros(1, pad)], dim=1).reshape(-1, 8)
            t = clip.get_text_features(input_ids=segments, attention_mask=mask).pooler_output
            states = model.model.vision_tower(inputs["pixel_values"], output_hidden_states=True).hidden_states
            patches = states[model.config.vision_feature_layer][0, 1:]
            e = clip.visual_projection(model.model.vision_tower.post_layernorm(patches))
            x = model.model.multi_modal_projector(patches)
        assert segments.shape[0] >= 2  # the instruction spans several 8-token segments
        expected = select(x, e, t, keep_count(0.4, x.shape[0]), negate=True).tolist()
        alone = _kept(model, inputs, "cdpruner", text_tower=str(tmp_path / "clip"))
        assert alone == [[expected]] and alone == [stage[row:row + 1] for stage in batch]
    qwen, _ = _model("qwen2_vl")
    with pytest.raises(ValueError, match="pairs with a CLIP vision tower; qwen2_vl"):
        vtprune.wrap(qwen, "cdpruner", keep=0.4, text_tower=str(tmp_path / "clip"))
    vtprune.wrap(qwen, "cdpruner", keep=0.4).remove()  # the refusal left no hook behind


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_parity_release_keeps_the_default_selection(method):
    """The defaults are the releases' rules: ``parity="release"`` (vtprune's count, original positions) selects
    the same tokens."""
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", [(QUESTIONS[1], [random_image(96, 80, 5)])])
    assert _kept(model, inputs, method, parity="release") == _kept(model, inputs, method)


@pytest.mark.parametrize("method", TEXT_METHODS)
def test_a_prompt_ending_with_its_image_has_no_instruction(method):
    """No text after the image: CDPruner's relevance is uniform (its kernel is the plain similarity, as with
    ``relevance_weight=0``: ``exp(0) = 1``), MMTok covers the image's tokens only; batched with a question. The
    prompt ends on its image, so its last visual token is the query token, which every method keeps."""
    model, processor = _model("llava")
    processor.tokenizer.padding_side = "left"
    images = [random_image(96, 80, 5), random_image(64, 96, 6)]
    texts = ["USER: describe <image>", f"USER: <image>\n{QUESTIONS[0]} ASSISTANT:"]
    batch = dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
    alone = dict(processor(text=texts[:1], images=images[:1], return_tensors="pt"))
    kept = _kept(model, batch, method)
    assert _kept(model, alone, method) == [stage[:1] for stage in kept]
    if method == "cdpruner":  # the plain DPP of the projector's outputs, computed here
        from vtprune.config import keep_count
        from vtprune.methods.cdpruner import conditional_kernel, dpp_greedy_order

        with torch.no_grad():
            states = model.model.vision_tower(alone["pixel_values"], output_hidden_states=True).hidden_states
            x = model.model.multi_modal_projector(states[model.config.vision_feature_layer][0, 1:])
        count, query = keep_count(0.4, x.shape[0]), x.shape[0] - 1  # the prompt ends on its last visual token
        picks = dpp_greedy_order(conditional_kernel(x, torch.ones(x.shape[0])), count).tolist()
        # the query token (the row the next token is read from) is kept inside the count; the best others join it
        assert kept[0][0] == sorted([query, *[p for p in picks if p != query][:count - 1]])
