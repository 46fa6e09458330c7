"""VisionZip, DivPrune, DART and temporal pruning: their math against hand-computed cases, their
vision-tower maps against the model's own attention, merging in batches, and their errors."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from vtprune.adapters import get_adapter
from vtprune.adapters.base import VisualSegment

import vtprune
from vtprune.config import keep_count
from vtprune.methods.dart import duplication_order, pivot_quotas, top_slots
from vtprune.methods.divprune import cosine_distance, max_min_order
from vtprune.methods.temporal import FIRST, previous_positions, temporal_scores
from vtprune.methods.tower import merge_units, received_attention
from vtprune.methods.visionzip import contextual_count, contextual_merge, evenly_spaced
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
S = 1 / math.sqrt(2)


@functools.cache
def _model(model_type: str, impl: str = "sdpa"):
    return tiny_model(model_type, impl, image_size=112)


# -- DivPrune ------------------------------------------------------------------------------------------------
def test_divprune_greedy_max_min_by_hand():
    # d = 1 - cos: d01 = d12 = 0.293, d02 = d23 = 1, d03 = 2, d13 = 1.707. Nearest other: 0.293, 0.293, 0.293, 1
    # -> x3 first; farthest from {3}: x0 (2); then x2 (min(1, 1) = 1 beats x1's min(1.707, 0.293)); then x1.
    x = torch.tensor([[1.0, 0.0], [S, S], [0.0, 1.0], [-1.0, 0.0]])
    distance = cosine_distance(x)
    assert distance[0, 3].item() == pytest.approx(2.0) and distance[1, 3].item() == pytest.approx(1 + S)
    assert max_min_order(distance, 4).tolist() == [3, 0, 2, 1]
    assert max_min_order(distance, 2).tolist() == [3, 0]
    assert max_min_order(distance[:1, :1], 3).tolist() == [0]  # one token: itself
    assert max_min_order(cosine_distance(torch.ones(3, 2)), 3).tolist() == [0, 1, 2]  # duplicates: in order


# -- DART ------------------------------------------------------------------------------------------------------
def test_dart_pivot_quotas_share_the_budget_exactly():
    assert pivot_quotas(10, 4) == [3, 3, 2, 2]
    assert pivot_quotas(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert pivot_quotas(0, 2) == [0, 0] and pivot_quotas(5, 0) == []


def test_dart_keeps_the_tokens_least_similar_to_each_pivot_by_hand():
    # slots 0, 1 pivots p = e1, q = e2; candidates a = (1, .1), b = e2, c = (-1, .2), d = (.5, .5).
    # cos with p: a .995, b 0, c -.98, d .707 -> p (quota 2) takes c, b; q (quota 1) over {a, d}: a (.0995 < .707).
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.0, 1.0], [-1.0, 0.2], [0.5, 0.5]])
    order = duplication_order(hidden, torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5]), [2, 1])
    assert order.tolist() == [4, 3, 2]
    assert top_slots(torch.tensor([3.0, 5.0, 5.0, 1.0]), torch.tensor([True, True, True, False]), 2).tolist() == [1, 2]


# -- VisionZip -------------------------------------------------------------------------------------------------
def test_visionzip_counts_and_targets():
    assert [contextual_count(k, 10 / 64, 1) for k in (64, 128, 192, 8, 2)] == [10, 20, 30, 1, 0]
    assert contextual_count(64, 10 / 64, 0) == 0  # nothing pruned (keep = 1): no merge
    assert evenly_spaced(10, 3).tolist() == [0, 3, 6] and evenly_spaced(5, 2).tolist() == [0, 2]
    assert evenly_spaced(2, 5).tolist() == [0, 1]


def test_visionzip_contextual_merge_by_hand():
    # targets 0 and 2 (step 5 // 2); keys: 1 and 4 are closest to target 0, 3 to target 2.
    hidden = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    keys = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [1.0, 0.05]])
    index, merged = contextual_merge(hidden, keys, 2)
    assert index.tolist() == [0, 2]
    torch.testing.assert_close(merged, torch.tensor([[8 / 3], [3.5]]))


def test_tower_received_attention_and_merge_units_by_hand():
    # one head, q = k = [[1], [0]]: rows softmax([1, 0]) and softmax([0, 0]); received = column means.
    q = torch.tensor([[[1.0], [0.0]]])
    e = math.e / (math.e + 1)
    expected = torch.tensor([(e + 0.5) / 2, (1 - e + 0.5) / 2])
    torch.testing.assert_close(received_attention(q, q, 1.0), expected)
    torch.testing.assert_close(received_attention(q, q, 1.0, chunk=1), expected)
    values, keys = merge_units(torch.arange(1.0, 9.0), torch.arange(16.0).reshape(8, 2), 4, torch.tensor([1, 0]))
    assert values.tolist() == [26.0, 10.0] and keys.tolist() == [[11.0, 12.0], [3.0, 4.0]]


def test_visionzip_dominant_tokens_follow_clip_cls_attention():
    """Kept tokens = top CLS attention of the feature layer, read from the tower's own eager attention."""
    model, processor = _model("llava", "eager")
    inputs = tiny_inputs(processor, "llava", [("what color is the circle?", [random_image(120, 90, 1)])])
    with torch.no_grad():
        out = model.model.vision_tower(inputs["pixel_values"], output_attentions=True)
        layer = len(out.attentions) + model.config.vision_feature_layer
        cls = out.attentions[layer].mean(dim=1)[0, 0, 1:]  # heads averaged, CLS query, patch keys
        with vtprune.apply(model, "visionzip", keep=0.25, contextual=0.0) as handle:
            model(**inputs)
            kept = handle.last_stats.kept_indices[0][0]
    assert sorted(kept) == sorted(torch.topk(cls, len(kept)).indices.tolist())


def test_qwen25_window_order_is_undone_like_the_model():
    """The merger applied to its (window-ordered) input, reordered by the adapter, equals the model's output."""
    model, processor = _model("qwen2_5_vl")
    adapter = get_adapter(model)
    inputs = tiny_inputs(processor, "qwen2_5_vl", [("how many?", [random_image(120, 90, 1), random_image(64, 64, 2)])])
    seen = {}
    hook = adapter.vision_tower.merger.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        out = adapter.vision_tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        hook.remove()
        order = adapter.vit_merged_order(inputs["image_grid_thw"])
        assert not torch.equal(order, torch.arange(order.numel()))  # the tiny model does use windows
        torch.testing.assert_close(adapter.vision_tower.merger(seen["x"])[order], out.pooler_output)


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_5_vl"])
def test_visionzip_merges_contextual_tokens_and_a_batch_equals_its_samples(model_type):
    model, processor = _model(model_type)
    samples = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    batch = tiny_inputs(processor, model_type, samples)
    merged = []
    with torch.no_grad(), vtprune.apply(model, "visionzip", keep=0.5) as handle:
        handle.observe(lambda record: merged.append(int(record.merged.sum())))
        logits = model(**batch).logits[:, -1]
        stats = handle.last_stats
        kept = stats.kept_indices[0]
        for row, sample in enumerate(samples):
            alone = model(**tiny_inputs(processor, model_type, [sample])).logits[:, -1]
            assert handle.last_stats.kept_indices[0][0] == kept[row]
            torch.testing.assert_close(alone[0], logits[row], atol=1e-4, rtol=0)
    assert stats.kept[0] == [keep_count(0.5, n) for n in stats.visual_tokens]  # the merge keeps the count
    assert merged[0] > 0  # contextual tokens were written


# -- temporal ---------------------------------------------------------------------------------------------------
def test_temporal_previous_positions():
    video = [VisualSegment(0, 3, 1, 2, kind="video")]
    assert previous_positions(video, 6).tolist() == [-1, -1, 0, 1, 2, 3]
    frames = [VisualSegment(0, 1, 2, 2), VisualSegment(4, 1, 1, 3, kind="tiles"),
              VisualSegment(7, 1, 2, 2), VisualSegment(11, 1, 1, 3, kind="tiles")]
    assert previous_positions(frames, 14).tolist() == [-1] * 7 + [0, 1, 2, 3, 4, 5, 6]
    other = [VisualSegment(0, 1, 2, 2), VisualSegment(4, 1, 3, 3)]  # different grids: nothing to compare
    assert (previous_positions(other, 13) == -1).all()


def test_temporal_scores_by_hand():
    # frames of 2 tokens: f0 = [e1, e2], f1 = [e1, e1], f2 = [-e1, e1].
    e1, e2 = [1.0, 0.0], [0.0, 1.0]
    x = torch.tensor([e1, e2, e1, e1, [-1.0, 0.0], e1])
    scores = temporal_scores(x, previous_positions([VisualSegment(0, 3, 1, 2, kind="video")], 6))
    # later frames: 1 - cos with the same position before: 0, 1, 2, 0. First frame: FIRST + 1 + cos with the
    # token after it: e1 -> e1 (cos 1), e2 -> e1 (cos 0).
    torch.testing.assert_close(scores, torch.tensor([FIRST + 2, FIRST + 1, 0.0, 1.0, 2.0, 0.0]))


def test_temporal_keeps_the_first_frame_of_a_static_video_and_refuses_images():
    model, processor = _model("qwen2_vl")
    frame = random_image(64, 64, 3)
    still = tiny_inputs(processor, "qwen2_vl", [("how many?", [frame, frame, frame])])
    with torch.no_grad(), vtprune.apply(model, "temporal", keep=1 / 3) as handle:
        model(**still)
        total = handle.last_stats.visual_tokens[0]
        assert handle.last_stats.kept_indices[0][0] == list(range(total // 3))
        with pytest.raises(ValueError, match="video.*sample 0 has 1 visual segment"):
            model(**tiny_inputs(processor, "qwen2_vl", [("how many?", [frame])]))


# -- errors at wrap time -------------------------------------------------------------------------------------
def test_bad_options_and_unsupported_layers_are_refused_at_wrap_time():
    llava, _ = _model("llava")
    with pytest.raises(ValueError, match="vit_layer=7 is outside the 2-layer vision tower"):
        vtprune.wrap(llava, "visionzip", keep=0.25, vit_layer=7)
    with pytest.raises(ValueError, match=r"contextual=1\.5"):
        vtprune.wrap(llava, "visionzip", keep=0.25, contextual=1.5)
    with pytest.raises(ValueError, match="pivot_image=-1"):
        vtprune.wrap(llava, "dart", keep=0.25, pivot_image=-1)
    qwen25, _ = _model("qwen2_5_vl")
    with pytest.raises(ValueError, match="attends within windows.*full-attention block: one of \\[1\\]"):
        vtprune.wrap(qwen25, "visionzip", keep=0.25, vit_layer=0)
    qwen3, _ = _model("qwen3_vl")
    for method in ("visionzip", "divprune", "temporal"):  # pre-LLM: DeepStack rows dropped with their tokens
        handle = vtprune.wrap(qwen3, method, keep=0.25)
        assert handle.stages[0].layer == 0
        handle.remove()
    with pytest.raises(ValueError, match="cannot prune at layer 1: DeepStack"):
        vtprune.wrap(qwen3, "divprune", schedule="1:0.25")
    with pytest.raises(ValueError, match="cannot prune before the first decoder layer"):
        vtprune.wrap(llava, "dart", keep=0.25, layer=0)


def test_visionzip_query_option():
    llava, _ = _model("llava")
    with pytest.raises(ValueError, match="query='cls'.*has no CLS token"):
        vtprune.wrap(_model("qwen2_vl")[0], "visionzip", keep=0.25, query="cls")
    with pytest.raises(ValueError, match="query='first'"):
        vtprune.wrap(llava, "visionzip", keep=0.25, query="first")
