"""``positions="compact"`` at a pre-LLM stage (layer 0): the wrapped model equals the unwrapped model run on a
really shortened prompt (the kept rows of its LM input embeddings, nothing else), as a serving engine that
takes pruned embeddings runs it; decode steps continue from the shortened length. Qwen-VL (M-RoPE) refuses."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)
STEPS = 4
SUPPRESS = list(range(len(SPECIAL_TOKENS)))


@functools.cache
def _model(model_type: str = "llava"):
    return tiny_model(model_type, "sdpa", image_size=112)


def _generate(model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             suppress_tokens=SUPPRESS, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, -STEPS:], torch.stack(out.logits, dim=1)


def _shortened(model, inputs: dict, kept: list[int]) -> torch.Tensor:
    """``[1, L', D]``: the unwrapped model's LM input embeddings of one sample, text rows and the visual rows
    with ordinals ``kept`` only (plain indexing; no vtprune code)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    ids = inputs["input_ids"][0]
    visual = (ids == model.config.image_token_id).nonzero().flatten()
    keep = torch.ones(ids.shape[0], dtype=torch.bool)
    keep[visual] = False
    keep[visual[torch.tensor(kept, dtype=torch.long)]] = True
    return captured["embeds"][:, keep]


@pytest.mark.parametrize(("method", "options"), [("divprune", {}), ("random", {"schedule": "0:0.5", "seed": 2})])
@pytest.mark.parametrize("rows", [1, 2])
def test_compact_pre_llm_stage_equals_a_shortened_prompt(method, options, rows):
    model, processor = _model()
    samples = two_samples("llava")[:rows]
    inputs = tiny_inputs(processor, "llava", samples)
    with vtprune.apply(model, method, keep=0.25, positions="compact", **options) as handle:
        assert handle.stages[0].layer == 0
        tokens, logits = _generate(model, **inputs)
        kept = handle.last_stats.kept_indices[0]
    for row, sample in enumerate(samples):
        alone = tiny_inputs(processor, "llava", [sample])
        short = _shortened(model, alone, kept[row])
        ref_tokens, ref_logits = _generate(model, inputs_embeds=short,
                                           attention_mask=torch.ones(short.shape[:2], dtype=torch.long))
        assert torch.equal(tokens[row], ref_tokens[0])
        torch.testing.assert_close(logits[row], ref_logits[0], atol=1e-4, rtol=0)


def test_original_positions_differ_from_the_shortened_prompt():
    """The default keeps the original position ids: the setting has an effect (the test above can fail)."""
    model, processor = _model()
    inputs = tiny_inputs(processor, "llava", two_samples("llava")[:1])
    with vtprune.apply(model, "divprune", keep=0.25) as handle:
        _, logits = _generate(model, **inputs)
        kept = handle.last_stats.kept_indices[0]
    short = _shortened(model, inputs, kept[0])
    _, ref_logits = _generate(model, inputs_embeds=short, attention_mask=torch.ones(short.shape[:2], dtype=torch.long))
    assert (logits[0, 0] - ref_logits[0, 0]).abs().max() > 1e-3


def test_compact_positions_are_refused_for_mrope():
    model, _ = _model("qwen2_vl")
    with pytest.raises(ValueError, match="positions='compact' is not supported for qwen2_vl"):
        vtprune.wrap(model, "divprune", keep=0.25, positions="compact")


def test_compact_pre_llm_then_in_lm_stage_equals_the_reference():
    """A pre-LLM stage then an in-LM stage, both compact, ragged batch: each row equals the independent
    no-cache reference that numbers the kept tokens of every stage consecutively."""
    from independent_reference import reference_decode

    model, processor = _model()
    samples = two_samples("llava")
    with vtprune.apply(model, "random", keep=0.25, schedule="0:0.5,2:0.25", positions="compact") as handle:
        tokens, logits = _generate(model, **tiny_inputs(processor, "llava", samples))
        kept, stages = handle.last_stats.kept_indices, [s.layer for s in handle.stages]
    for row, sample in enumerate(samples):
        alone = tiny_inputs(processor, "llava", [sample])
        ref_tokens, ref_logits = reference_decode(model, alone, stages, [k[row] for k in kept], STEPS,
                                                  len(SUPPRESS), compact=True)
        assert torch.equal(tokens[row], ref_tokens)
        torch.testing.assert_close(logits[row], ref_logits, atol=1e-4, rtol=0)
