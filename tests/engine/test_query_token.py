"""The query token (each sample's last prompt token) is never pruned, whatever the method.

A raw prompt may end on an image token (image-only captioning: ``"USER: <image>"``). Before, FastV and PyramidDrop
could prune that token: the next-token logit was NaN and ``generate`` emitted ``<pad>``. The engine's selection
(``vtprune.prefill.select_with_query``, shared with the vLLM plugin) keeps it inside the sample's kept count.

Expected values are independent of the engine: the kept set is recomputed here from the stage's own scores (the
query token plus the top ``count - 1`` other visual tokens, plain sorting), and the logits come from
``tests/independent_reference.py`` (the unwrapped model's layers on those tokens, plain indexing, no cache).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from independent_reference import reference_step

import vtprune
from vtprune.models.tiny import random_image, tiny_model
from vtprune.prefill import query_slots, select_with_query

torch.set_num_threads(1)
ATOL = 1e-4
LAYERWISE = ("fastv", "pdrop", "transprune", "ttv", "dart")


@dataclass(frozen=True)
class LastOut(vtprune.Scorer):
    """Scores later visual tokens lower: without the rule the query token is always the first one pruned."""

    def score(self, ctx):
        return -ctx.ordinal.float()


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


def _ending_on_image(model_type: str, processor, width: int = 120, height: int = 90, seed: int = 1) -> dict:
    """One sample whose prompt's last token is its image's last visual token."""
    if model_type.startswith("qwen"):
        text = "<|im_start|>user\ndescribe<|vision_start|><|image_pad|>"
    else:
        text = "USER: describe <image>"
    inputs = dict(processor(text=[text], images=[random_image(width, height, seed)], return_tensors="pt"))
    image_token = _model(model_type)[0].config.image_token_id
    if int(inputs["input_ids"][0, -1]) != image_token:
        raise AssertionError(f"{model_type}: the prompt does not end on an image token")
    return inputs


def _count(keep: float, n: int) -> int:
    return max(1, math.floor(keep * n + 0.5))


def _expected_kept(record, row: int, count: int) -> list[int]:
    """The query token's ordinal plus the ``count - 1`` best other alive visual tokens of ``record`` (sorting only)."""
    visual = record.visual[row]
    ordinals = record.ordinal[row][visual].tolist()
    scores = record.scores[row].float()[visual].tolist()
    query = ordinals[-1]  # the last visual slot is the prompt's last token
    others = sorted(range(len(ordinals) - 1), key=lambda i: (-scores[i], i))[:count - 1]
    return sorted([query, *(ordinals[i] for i in others)])


# -- the pure rule ------------------------------------------------------------------------------------------------
def test_query_slots_mark_each_samples_last_valid_slot_left_or_right_padded():
    valid = torch.tensor([[False, True, True, True], [True, True, False, False], [True, True, True, True]])
    assert query_slots(valid).tolist() == [[False, False, False, True], [False, True, False, False],
                                            [False, False, False, True]]


def test_a_visual_query_is_kept_inside_the_count():
    visual = torch.tensor([[False, True, True, True, True], [False, True, True, True, False]])
    valid = torch.ones(2, 5, dtype=torch.bool)
    scores = torch.tensor([[0.0, 0.9, 0.5, 0.7, 0.1], [0.0, 0.9, 0.5, 0.7, 0.2]])
    kept = select_with_query(scores, visual, valid, torch.tensor([2, 2]))
    # row 0 ends on a visual token scored lowest: it is kept with the best other one; row 1 ends on text
    assert kept.tolist() == [[True, True, False, False, True], [True, True, False, True, True]]
    assert (kept & visual).sum(dim=1).tolist() == [2, 2]


# -- whole models --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("method", [*LAYERWISE, "random@0", "last_out"])
def test_a_prompt_ending_on_an_image_keeps_its_query_token(model_type, method):
    model, processor = _model(model_type)
    inputs = _ending_on_image(model_type, processor)
    keep = 0.25
    if method == "last_out":
        scorer, options = LastOut(), {"schedule": "1:0.5,2:0.25"}
    elif method == "random@0":
        scorer, options = "random", {"layer": 0, "seed": 2}
    else:
        scorer, options = method, {}
    records = []
    with torch.no_grad(), vtprune.apply(model, scorer, keep=keep, **options) as handle:
        handle.observe(records.append)
        out = model(**inputs)
        stats = handle.last_stats
        stages = [stage.layer for stage in handle.stages]
    n = stats.visual_tokens[0]
    last = out.logits[0, -1].float()
    assert last.isfinite().all(), f"{method}: NaN next-token logit"
    expected = [_expected_kept(record, 0, _count(stage.keep, n)) for record, stage in zip(records, handle.stages)]
    assert [kept[0] for kept in stats.kept_indices] == expected  # inside the budget: the plan's counts
    want = reference_step(model, inputs, inputs["input_ids"], stages, expected).float()
    torch.testing.assert_close(last, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_generate_from_a_prompt_ending_on_an_image_in_a_ragged_batch(model_type):
    """Right- and left-padded batches of two prompts ending on images of different sizes: every sample's
    next-token logits are finite and those it gets alone."""
    model, processor = _model(model_type)
    singles = [_ending_on_image(model_type, processor, 120, 90, 1), _ending_on_image(model_type, processor, 64, 64, 2)]
    want = []
    with torch.no_grad(), vtprune.apply(model, LastOut(), keep=0.25, schedule="2:0.25"):
        for single in singles:
            logits = model(**single).logits[0, -1]
            assert logits.isfinite().all()
            want.append(logits.float())
        for side in ("left", "right"):
            processor.tokenizer.padding_side = side
            prompt = ("<|im_start|>user\ndescribe<|vision_start|><|image_pad|>" if model_type.startswith("qwen")
                      else "USER: describe <image>")
            batch = dict(processor(text=[prompt, prompt], images=[random_image(120, 90, 1), random_image(64, 64, 2)],
                                   return_tensors="pt", padding=True))
            processor.tokenizer.padding_side = "left"
            logits = model(**batch).logits
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            rows = [logits[b, -1] if side == "left" else logits[b, lengths[b] - 1] for b in range(2)]
            for row, expected in zip(rows, want, strict=True):
                torch.testing.assert_close(row.float(), expected, atol=ATOL, rtol=0, msg=side)
