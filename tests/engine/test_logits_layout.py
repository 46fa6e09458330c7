"""Logits of a pruned prefill in the input layout (``logits="input"``), against the independent reference.

A pruned prefill runs the layers after a stage on the kept tokens only. By default (``logits="input"``) the
engine puts the language model's last hidden state back in the input layout, so code that indexes logits by
input position (right padding, per-token log-likelihood, ``labels=``) gets the right rows; the expected
values come from ``tests/independent_reference.py`` (the same kept tokens run by hand, no cache, no vtprune
code). ``logits="pruned"`` keeps one row per kept token, mapped by ``output.kept_positions``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from independent_reference import reference_step

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, prompt_for, random_image, tiny_inputs, tiny_model
from vtprune.outputs import final_positions, to_input_layout, to_pruned_layout

torch.set_num_threads(1)
ATOL = 1e-4
CONTINUATION = " red circle top left"
# (model type, method, options): in-LM single stage, in-LM multi-stage, pre-LLM stages.
CASES = [
    ("llava", "fastv", {"layer": 2}),
    ("llava", "pdrop", {"schedule": "1:0.6,2:0.4,3:0.25"}),
    ("llava", "divprune", {}),
    ("qwen2_vl", "fastv", {"layer": 2}),
    ("qwen2_vl", "random", {"layer": 0, "seed": 3}),
    ("llava_next", "fastv", {"layer": 2}),
    ("llava_onevision", "random", {"layer": 0, "seed": 1}),
    ("qwen2_5_vl", "pdrop", {"schedule": "1:0.6,2:0.4,3:0.25"}),
]
IDS = [f"{m}-{method}" for m, method, _ in CASES]


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


def _samples(model_type: str) -> list[tuple[str, list]]:
    """Two samples of different lengths (LLaVA: one and two images), questions ending in a continuation."""
    if model_type.startswith("qwen"):
        return [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    return [("what color is the circle?", [random_image(120, 90, 1)]),
            ("how many squares?", [random_image(64, 80, 2), random_image(90, 60, 3)])]


def _encode(processor, model_type: str, samples: list, side: str, continuation: str = "") -> dict:
    texts = [prompt_for(model_type, q, len(images)) + continuation for q, images in samples]
    processor.tokenizer.padding_side = side
    try:
        return dict(processor(text=texts, images=[i for _, imgs in samples for i in imgs], return_tensors="pt",
                              padding=True))
    finally:
        processor.tokenizer.padding_side = "left"


def _visual(model, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for name in ("image_token_id", "video_token_id"):
        token = getattr(model.config, name, None)
        if token is not None:
            mask |= ids == token
    return mask


def _reference_logits(model, alone: dict, stages: list[int], kept: list[list[int]], positions: list[int]
                      ) -> torch.Tensor:
    """``[len(positions), V]``: the reference's logits at each input position (at or after the last visual token)
    of one unpadded sample ``alone``; the prefix given to the reference ends at the last visual token."""
    ids = alone["input_ids"]
    start = int(_visual(model, ids)[0].nonzero().max()) + 1
    prompt = {k: v[:, :start] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
              for k, v in alone.items()}
    return torch.stack([reference_step(model, prompt, ids[:, :p + 1], stages, kept) for p in positions]).float()


def _run(model, batch: dict, method: str, options: dict, **kwargs):
    with torch.no_grad(), vtprune.apply(model, method, keep=0.3, **options) as handle:
        out = model(**batch, **kwargs)
    return out, handle.last_stats, [s.layer for s in handle.stages]


# -- the pure mapping ----------------------------------------------------------------------------------------
def test_final_positions_compose_a_pre_llm_stage_and_mark_padding_rows():
    # Sample 0 keeps input positions 0, 2, 3 before the LLM, sample 1 keeps 1, 3 (left re-padded).
    pre_llm = torch.tensor([[0, 2, 3], [0, 1, 3]])
    index = torch.tensor([[0, 2], [1, 2]])  # then a stage keeps slots (0, 2) and (1, 2) of that layout
    valid = torch.tensor([[True, True], [False, True]])
    assert final_positions(index, valid, pre_llm).tolist() == [[0, 3], [-1, 3]]
    assert final_positions(index, valid).tolist() == [[0, 2], [-1, 2]]


def test_to_input_layout_fills_pruned_visual_with_nan_and_padding_with_zero():
    rows = torch.arange(1.0, 7.0).view(2, 3, 1)
    positions = torch.tensor([[0, 1, 3], [-1, 0, 2]])
    visual = torch.tensor([[False, True, True, False], [False, True, False, False]])
    out = to_input_layout(rows, positions, visual)[..., 0]
    assert out[0, :2].tolist() == [1.0, 2.0] and math.isnan(out[0, 2]) and out[0, 3] == 3.0
    assert out[1, 0] == 5.0 and math.isnan(out[1, 1]) and out[1, 2:].tolist() == [6.0, 0.0]  # position 3: padding
    back = to_pruned_layout(to_input_layout(rows, positions, visual), positions)
    assert torch.equal(back[positions >= 0], rows[positions >= 0]) and back[1, 0].isnan().all()


def test_logits_option_is_checked():
    with pytest.raises(ValueError, match="logits must be 'input'"):
        vtprune.PruneConfig(method="fastv", logits="kept")
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="logits must be 'input'"):
        vtprune.wrap(model, "fastv", keep=0.5, logits=None)
    assert not hasattr(model, "_vtprune_handle") or not model._vtprune_handle.active


# -- against the independent reference ---------------------------------------------------------------------
@pytest.mark.parametrize("model_type, method, options", CASES, ids=IDS)
def test_right_padded_last_token_equals_the_reference(model_type, method, options):
    """``logits[b, mask[b].sum() - 1]`` of a right-padded batch is sample b's next-token logit."""
    model, processor = _model(model_type)
    samples = _samples(model_type)
    batch = _encode(processor, model_type, samples, "right")
    out, stats, stages = _run(model, batch, method, options)
    lengths = batch["attention_mask"].sum(dim=1)
    for b, sample in enumerate(samples):
        alone = _encode(processor, model_type, [sample], "left")
        kept = [stage[b] for stage in stats.kept_indices]
        expected = _reference_logits(model, alone, stages, kept, [alone["input_ids"].shape[1] - 1])[0]
        torch.testing.assert_close(out.logits[b, int(lengths[b]) - 1].float(), expected, atol=ATOL, rtol=0)
    assert out.logits.shape[:2] == batch["input_ids"].shape


@pytest.mark.parametrize("model_type, method, options", CASES, ids=IDS)
def test_per_token_loglikelihood_of_the_text_equals_the_reference(model_type, method, options):
    """Every text position after the images (a right-padded batch of prompt + continuation): logits, the
    log-likelihood of the continuation, and the model's own ``labels=`` loss equal the reference's."""
    model, processor = _model(model_type)
    samples = _samples(model_type)
    batch = _encode(processor, model_type, samples, "right", CONTINUATION)
    n_cont = len(processor.tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"])
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    labels = torch.full_like(batch["input_ids"], -100)
    for b, n in enumerate(lengths):
        labels[b, n - n_cont:n] = batch["input_ids"][b, n - n_cont:n]
    out, stats, stages = _run(model, batch, method, options, labels=labels)
    with torch.no_grad():
        plain = model(**batch).logits
    total_nll, total_tokens = 0.0, 0
    for b, sample in enumerate(samples):
        alone = _encode(processor, model_type, [sample], "left", CONTINUATION)
        ids = alone["input_ids"][0]
        visual = _visual(model, alone["input_ids"])[0]
        first, last = int(visual.nonzero().min()), int(visual.nonzero().max())
        text = list(range(last + 1, len(ids)))
        kept = [stage[b] for stage in stats.kept_indices]
        expected = _reference_logits(model, alone, stages, kept, text)
        torch.testing.assert_close(out.logits[b, last + 1:lengths[b]].float(), expected, atol=ATOL, rtol=0)
        # Before the first visual token nothing is pruned yet: the unwrapped model's values.
        torch.testing.assert_close(out.logits[b, :first], plain[b, :first], atol=1e-5, rtol=0)
        targets = ids[len(ids) - n_cont:]
        got = torch.log_softmax(out.logits[b, lengths[b] - n_cont - 1:lengths[b] - 1].float(), -1)
        want = torch.log_softmax(expected[-n_cont - 1:-1], -1)
        lp_got = got.gather(-1, targets[:, None]).sum()
        lp_want = want.gather(-1, targets[:, None]).sum()
        assert float(lp_got) == pytest.approx(float(lp_want), abs=1e-3)
        total_nll -= float(lp_want)
        total_tokens += n_cont
        # Pruned visual positions have no logit (NaN); kept ones are finite.
        pruned = visual.clone()
        pruned[visual.nonzero().flatten()[torch.tensor(kept[-1])]] = False
        assert out.logits[b, :len(ids)][pruned].isnan().all() and out.logits[b, :len(ids)][~pruned].isfinite().all()
    assert float(out.loss) == pytest.approx(total_nll / total_tokens, abs=1e-4)


@pytest.mark.parametrize("model_type, method, options", [CASES[0], CASES[4]], ids=[IDS[0], IDS[4]])
def test_keep_one_equals_unwrapped_in_both_layouts(model_type, method, options):
    model, processor = _model(model_type)
    batch = _encode(processor, model_type, _samples(model_type), "right", CONTINUATION)
    valid = batch["attention_mask"].bool()
    with torch.no_grad():
        plain = model(**batch).logits
        with vtprune.apply(model, method, keep=1.0, **options):
            same = model(**batch)
        with vtprune.apply(model, method, keep=1.0, logits="pruned", **options):
            rows = model(**batch)
    torch.testing.assert_close(same.logits[valid], plain[valid], atol=1e-5, rtol=0)
    mapped = rows.kept_positions >= 0
    assert int(mapped.sum()) == int(valid.sum())  # every valid input position has exactly one row
    torch.testing.assert_close(rows.logits[mapped], to_pruned_layout(plain, rows.kept_positions)[mapped],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type, method, options", [CASES[1], CASES[4]], ids=[IDS[1], IDS[4]])
def test_pruned_layout_rows_are_the_input_layout_rows_at_kept_positions(model_type, method, options):
    model, processor = _model(model_type)
    batch = _encode(processor, model_type, _samples(model_type), "right")
    full, stats, _ = _run(model, batch, method, options)
    rows, stats_rows, _ = _run(model, batch, method, {**options, "logits": "pruned"})
    assert stats.kept_indices == stats_rows.kept_indices
    assert torch.equal(full.kept_positions, rows.kept_positions)
    assert rows.logits.shape[1] == rows.kept_positions.shape[1] < batch["input_ids"].shape[1]
    mapped = rows.kept_positions >= 0
    torch.testing.assert_close(to_pruned_layout(full.logits, rows.kept_positions)[mapped], rows.logits[mapped],
                               atol=1e-5, rtol=0)
    padding = ~batch["attention_mask"].bool()
    assert (full.logits[padding] == 0).all()  # padding positions: finite zeros


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_generate_and_logits_to_keep_in_the_input_layout(model_type):
    """generate (left padding, one logit row at prefill) is the same in both layouts; ``logits_to_keep=k`` gives
    the last k input positions."""
    model, processor = _model(model_type)
    batch = tiny_inputs(processor, model_type, _samples(model_type))
    options = dict(max_new_tokens=3, do_sample=False, suppress_tokens=list(range(len(SPECIAL_TOKENS))),
                   output_logits=True, return_dict_in_generate=True)
    results = {}
    with torch.no_grad():
        for layout in ("input", "pruned"):
            with vtprune.apply(model, "fastv", keep=0.3, layer=2, logits=layout):
                results[layout] = model.generate(**batch, **options)
        with vtprune.apply(model, "fastv", keep=0.3, layer=2):
            full = model(**batch).logits
            last = model(**batch, logits_to_keep=4).logits
    assert torch.equal(results["input"].sequences, results["pruned"].sequences)
    for a, b in zip(results["input"].logits, results["pruned"].logits, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(last, full[:, -4:], atol=1e-6, rtol=0)


def test_decode_steps_and_text_only_calls_carry_no_positions():
    model, processor = _model("llava")
    batch = tiny_inputs(processor, "llava", _samples("llava")[:1])
    text = processor.tokenizer(["USER: hello ASSISTANT:"], return_tensors="pt")
    with torch.no_grad(), vtprune.apply(model, "fastv", keep=0.3, layer=2):
        prefill = model(**batch, use_cache=True)
        step = model(input_ids=batch["input_ids"][:, -1:], cache=prefill.cache,
                     attention_mask=torch.ones(1, batch["input_ids"].shape[1] + 1, dtype=torch.long))
        plain = model(**text)
    assert prefill.kept_positions.shape[0] == 1 and prefill.logits.shape[1] == batch["input_ids"].shape[1]
    assert not hasattr(step, "kept_positions") and step.logits.shape[1] == 1
    assert not hasattr(plain, "kept_positions")


@dataclass(frozen=True)
class EarliestFirst(vtprune.Scorer):
    """Keeps each sample's earliest visual tokens: the last visual token of the last image is always pruned."""

    name: ClassVar[str] = "earliest-first"

    def score(self, ctx):
        return -ctx.ordinal.float()


@pytest.mark.parametrize("stage", [{"layer": 0}, {"layer": 2}], ids=["pre-llm", "layer-2"])
@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_labels_with_only_the_visual_positions_ignored_give_the_loss_of_the_predicted_tokens(model_type, stage):
    """LLaVA-style labels (every token but the visual ones and the padding) when an image's last visual token is
    pruned: the text token after it has no row that predicts it (a NaN row), so its label is ignored and the loss is
    the mean cross-entropy of every other label, computed here from the returned logits (it was NaN)."""
    model, processor = _model(model_type)
    batch = _encode(processor, model_type, _samples(model_type), "right", CONTINUATION)
    visual = _visual(model, batch["input_ids"])
    labels = batch["input_ids"].masked_fill(visual | (batch["attention_mask"] == 0), -100)
    given = labels.clone()
    with torch.no_grad(), vtprune.apply(model, EarliestFirst(), keep=0.5, **stage):
        out = model(**batch, labels=labels)
    assert torch.equal(labels, given)  # the caller's tensor is not edited
    rows, targets = out.logits[:, :-1].float(), labels[:, 1:]
    predicted = rows.isfinite().all(dim=-1)
    unpredicted = (targets != -100) & ~predicted
    # Exactly the labelled tokens right after a pruned visual token: at least one per sample (its last image's).
    assert (unpredicted.sum(dim=1) >= 1).all() and visual[:, :-1][unpredicted].all()
    use = (targets != -100) & predicted
    expected = torch.nn.functional.cross_entropy(rows[use], targets[use])
    assert out.loss.isfinite() and float(out.loss) == pytest.approx(float(expected), abs=1e-5)


def test_labels_with_the_pruned_layout_are_refused_at_the_call():
    model, processor = _model("llava")
    batch = _encode(processor, "llava", _samples("llava"), "right", CONTINUATION)
    text = processor.tokenizer(["USER: hello ASSISTANT: hi"], return_tensors="pt")
    with torch.no_grad(), vtprune.apply(model, "fastv", keep=0.3, layer=2, logits="pruned") as handle:
        with pytest.raises(ValueError, match="labels= needs logits in the input layout"):
            model(**batch, labels=batch["input_ids"])
        plain = model(**text, labels=text["input_ids"])  # nothing pruned: the model's own loss
        assert plain.loss.isfinite() and handle.last_stats is None
        again = model(**batch)  # the refused call left nothing behind
    assert again.logits.shape[1] == again.kept_positions.shape[1] < batch["input_ids"].shape[1]
