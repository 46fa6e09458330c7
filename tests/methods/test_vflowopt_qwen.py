"""VFlowOpt on Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the ViT map math on hand examples, the recomputed block attention
against the tower's own eager weights, the whole map against an independent recomputation, and the engine
contract (keep=1, batch == alone, cached decoding) on the tiny models."""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
from transformers.vision_utils import get_vision_window_index
from vtprune.adapters.base import VisualSegment

import vtprune
from vtprune.methods import qwen_vit
from vtprune.methods.entropy import patch_entropy
from vtprune.methods.vit import cell_ids, context_relevance
from vtprune.models.tiny import SPECIAL_TOKENS, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SAMPLES = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]


@functools.cache
def _model(model_type: str, impl: str = "sdpa"):
    return tiny_model(model_type, impl, image_size=112)


def _options(model_type: str) -> dict:
    """Qwen3-VL prunes from layer 2 on (DeepStack): an explicit schedule; the others use VFlowOpt's."""
    return {"schedule": "2:0.6,3:0.4"} if model_type == "qwen3_vl" else {}


# -- pure functions ------------------------------------------------------------------------------------------
def test_streamed_relevance_equals_the_full_map():
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(3, 37, 8, generator=generator), torch.randn(3, 37, 8, generator=generator)
    scale = 8 ** -0.5
    full = torch.stack([torch.softmax(query[h] @ key[h].T * scale, dim=-1) for h in range(3)]).mean(dim=0)
    # Thresholds halfway between two tokens' received attention, never equal to one: the streamed sum adds in
    # another order than the full map, so a threshold on a token's own value could fall on either side of it.
    ranked = full.sum(dim=0).sort().values
    between = [float(ranked[i] + ranked[i + 1]) / 2 for i in (18, 35)]
    assert min(float(ranked[i + 1] - ranked[i]) for i in (18, 35)) > 1e-4  # the margins are far above rounding
    for threshold in (0.0, between[0], between[1], 1e9):  # all, half, one, none
        expected = context_relevance(full[None], threshold)[0]
        ours = qwen_vit.streamed_relevance(query, key, scale, threshold, block=5)
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


def test_pooling_window_order_and_per_image_cells_by_hand():
    values = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 4.0, 8.0])
    torch.testing.assert_close(qwen_vit.pool_groups(values, 4), torch.tensor([3.0, 3.0]))
    # A 4 x 8 patch image is 2 x 4 merged tokens; windows of 2 x 2 merged tokens hold tokens {0, 1, 4, 5} and
    # {2, 3, 6, 7}, so the blocks see merged tokens in the order 0 1 4 5 2 3 6 7.
    adapter = vtprune.wrap(_model("qwen2_5_vl")[0], "fastv", keep=1.0)
    try:
        order = adapter.adapter.vit_merged_order(torch.tensor([[1, 4, 8]]))
    finally:
        adapter.remove()
    windowed = torch.tensor([10.0, 11.0, 14.0, 15.0, 12.0, 13.0, 16.0, 17.0])
    assert qwen_vit.in_token_order(windowed, order).tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0]
    # Per-image cell sides: a 2 x 4 grid with a = 2 has cells {0, 1} on top; a 1 x 2 grid with a = 1 has two.
    ids = cell_ids([VisualSegment(0, 1, 2, 4), VisualSegment(8, 1, 1, 2)], 10, [2.0, 1.0])
    assert ids.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 3]


def test_pixel_entropy_map_by_hand():
    """Two merge groups of four 2x2 patches: entropies 0 / 1 / 2 / 0 and 0 / 0 / 0 / 0 bits."""
    patch, levels = 2, [[0, 0, 0, 0], [0, 0, 255, 255], [0, 85, 170, 255], [51, 51, 51, 51]] + [[7, 7, 7, 7]] * 4
    rows = torch.zeros(8, 3, 2, patch, patch)  # (C, temporal, P, P) per patch, both temporal slices equal
    for index, grey in enumerate(levels):
        rows[index] = torch.tensor(grey, dtype=torch.float32).view(1, 1, patch, patch) / 255.0
    stats = ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    ours = qwen_vit.pixel_entropy_map(rows.reshape(8, -1), torch.tensor([[1, 2, 4]]), stats, patch, 4)
    entropy = torch.tensor([0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert patch_entropy(rows[:, :, 0] * 255.0, patch)[:, 0].tolist() == entropy.tolist()
    weights = torch.exp(entropy) / torch.exp(entropy).sum()
    torch.testing.assert_close(ours, torch.stack([weights[:4].mean(), weights[4:].mean()]))


# -- the recomputed block attention equals the tower's eager weights -----------------------------------------
def _eager_block_weights(model_type: str, inputs: dict, monkeypatch) -> tuple[list, list, torch.Tensor]:
    """Per block: the tower's eager attention weights per frame ``[H, T, T]`` and the block's input and kwargs."""
    model, _ = _model(model_type, "eager")
    tower = model.model.visual
    modeling = sys.modules[type(tower.blocks[0].attn).__module__]
    recorded, inputs_seen = [], []
    original = modeling.eager_attention_forward

    def record(*args, **kwargs):
        output, weights = original(*args, **kwargs)
        recorded.append(weights[0].detach())
        return output, weights

    monkeypatch.setattr(modeling, "eager_attention_forward", record)
    hooks = [block.register_forward_pre_hook(lambda m, a, k: inputs_seen.append((a[0], dict(k))), with_kwargs=True)
             for block in tower.blocks]
    try:
        with torch.no_grad():
            tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    finally:
        for hook in hooks:
            hook.remove()
    return recorded, inputs_seen, tower


@pytest.mark.parametrize("model_type", QWEN)
def test_recomputed_block_attention_equals_the_towers_eager_weights(model_type, monkeypatch):
    _, processor = _model(model_type)
    inputs = tiny_inputs(processor, model_type, SAMPLES)
    recorded, seen, tower = _eager_block_weights(model_type, inputs, monkeypatch)
    frames, calls = len(inputs["image_grid_thw"]), iter(recorded)  # one eager call per block and chunk
    for index, (hidden, kwargs) in enumerate(seen):
        query, key = qwen_vit.block_qk(tower.blocks[index], hidden, kwargs["position_embeddings"])
        bounds = kwargs["cu_seqlens"].tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            eager = next(calls)
            ours = qwen_vit.head_mean_softmax(query[:, a:b], key[:, a:b], float(tower.blocks[index].attn.scaling))
            torch.testing.assert_close(ours, eager.float().mean(dim=0), atol=1e-6, rtol=1e-5)
        if index in (tower.fullatt_block_indexes if model_type == "qwen2_5_vl" else range(len(seen))):
            assert len(bounds) - 1 == frames  # full attention: one chunk per image


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_map_equals_an_independent_recomputation(model_type, monkeypatch):
    """Stage-0 scores = context relevance of the last full-attention block's eager map, threshold 35 T / 730,
    mean over each 2x2 merge group, Qwen2.5-VL's window order undone with the model's own window index."""
    model, processor = _model(model_type)
    inputs = tiny_inputs(processor, model_type, SAMPLES)
    recorded, seen, tower = _eager_block_weights(model_type, inputs, monkeypatch)
    block = len(tower.blocks) - 1  # Qwen2.5-VL's tiny tower: fullatt_block_indexes = [1]
    frames = len(seen[block][1]["cu_seqlens"]) - 1
    per_frame = recorded[-frames:]  # the last block's eager calls
    relevance = torch.cat([context_relevance(w.float().mean(dim=0)[None], 35.0 * w.shape[-1] / 730)[0]
                           for w in per_frame])
    merged = relevance.view(-1, 4).mean(dim=1)
    if model_type == "qwen2_5_vl":
        config = model.config.vision_config
        window = get_vision_window_index(inputs["image_grid_thw"], spatial_merge_size=2,
                                         window_size=config.window_size, patch_size=config.patch_size)[0]
        restored = torch.empty_like(merged)
        restored[window] = merged  # the block's j-th merged token is token window[j]
        merged = restored
    records = []
    with torch.no_grad(), vtprune.apply(model, "vflowopt", keep=0.5, recycle=False) as handle:
        handle.observe(records.append)
        model(**inputs)
    stage0 = records[0]
    counts = [n for n in stage0.visual_tokens]
    expected = torch.split(merged, counts)
    for row, values in enumerate(expected):
        slots = stage0.visual[row]
        order = stage0.ordinal[row, slots]
        torch.testing.assert_close(stage0.scores[row, slots], values[order], atol=1e-6, rtol=1e-5)


# -- the engine contract on Qwen -------------------------------------------------------------------------------
def _generate(model, inputs, steps=3):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


def _extended(inputs, generated):
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], generated[:, :-1]], dim=1)
    full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(generated[:, :-1])], dim=1)
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(generated[:, :-1])], 1)
    return full


@pytest.mark.parametrize("model_type", QWEN)
def test_vflowopt_qwen_keep_one_batch_alone_and_cached_decoding(model_type):
    model, processor = _model(model_type)
    batch = tiny_inputs(processor, model_type, SAMPLES)
    options = _options(model_type)
    with torch.no_grad():
        reference = model(**batch).logits
        ones = {"schedule": "2:1,3:1"} if options else {}
        with vtprune.apply(model, "vflowopt", keep=1.0, **ones):
            same = model(**batch).logits
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(same[valid], reference[valid], atol=1e-5, rtol=0)
    with vtprune.apply(model, "vflowopt", keep=0.4, alpha=0.5, **options) as handle:
        tokens, logits = _generate(model, batch)
        stats = handle.last_stats
        assert stats.kept[0][0] < stats.visual_tokens[0]
        for row, sample in enumerate(SAMPLES):
            alone = tiny_inputs(processor, model_type, [sample])
            alone_tokens, alone_logits = _generate(model, alone)
            assert [k[row] for k in stats.kept_indices] == [k[0] for k in handle.last_stats.kept_indices]
            assert torch.equal(alone_tokens[0], tokens[row])
            torch.testing.assert_close(alone_logits[0], logits[row], atol=1e-4, rtol=0)
            with torch.no_grad():  # cached decoding = a no-cache forward of prompt + generated tokens
                recomputed = model(**_extended(alone, alone_tokens), use_cache=False).logits[:, -alone_tokens.shape[1]:]
            torch.testing.assert_close(recomputed, alone_logits, atol=1e-4, rtol=0)


def test_recycling_per_merged_cell_selection():
    """The 120x90 image is 3 x 4 merged tokens (N = 12); a = 15.58 sqrt(12) / 27 = 1.9989: cells rows {0, 1} / {2}
    x cols {0, 1} / {2, 3}, n_merge = floor(12 / a^2) = 3. With R1 = 0.5 the engine keeps the top 6, the 3
    least important of them are demoted, and each occupied cell of the 9 candidates returns its best member."""
    model, processor = _model("qwen2_vl")
    inputs = tiny_inputs(processor, "qwen2_vl", SAMPLES[:1])
    _, h, w = (int(v) // m for v, m in zip(inputs["image_grid_thw"][0].tolist(), (1, 2, 2), strict=True))
    assert (h, w) == (3, 4)
    a = 15.58 * math.sqrt(12) / 27
    assert math.floor(12 / a**2) == 3
    cells = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3]]).flatten()
    assert cell_ids([VisualSegment(0, 1, h, w)], 12, a).tolist() == cells.tolist()
    records = []
    with torch.no_grad(), vtprune.apply(model, "vflowopt", keep=0.25, r1=0.5, r2=1.0) as handle:
        handle.observe(records.append)
        model(**inputs)
    stage = records[0]
    slots = stage.visual[0]
    importance = torch.empty(12)
    importance[stage.ordinal[0, slots]] = stage.scores[0, slots].float()
    ranked = importance.argsort(descending=True).tolist()
    kept = set(ranked[:3])  # top 6 kept, the last 3 of them demoted
    candidates = ranked[3:]
    for cell in cells[candidates].unique().tolist():
        members = [i for i in candidates if int(cells[i]) == cell]
        kept.add(max(members, key=lambda i: float(importance[i])))
    assert sorted(handle.last_stats.kept_indices[0][0]) == sorted(kept)
    assert stage.counts == [len(kept)]


def test_qwen_refusals_at_wrap_time():
    qwen25, _ = _model("qwen2_5_vl")
    pristine = [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in qwen25.named_modules()]
    with pytest.raises(ValueError, match=r"vit_layer=0 is not a full-attention block .* use one of \[1\]"):
        vtprune.wrap(qwen25, "vflowopt", keep=0.25, vit_layer=0)
    assert [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in qwen25.named_modules()] == pristine
    with pytest.raises(ValueError, match="qwen3_vl cannot prune at layer 1: DeepStack"):
        vtprune.wrap(_model("qwen3_vl")[0], "vflowopt", keep=0.25)
