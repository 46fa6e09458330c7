"""SparseVLM: the kept and recycled tokens equal the authors' release on fixed inputs, the math against hand-computed
cases, the schedule, the recycling step, and a batch with different questions equal to each sample alone."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vtprune.kernels import visual_attention_scores

import vtprune
from vtprune.methods.sparsevlm import (
    PRESETS,
    cluster_means,
    dpc_knn,
    rank_count,
    rater_rows,
    recycle_count,
    recycle_deleted,
    sparsevlm_schedule,
    stage_layers,
    text_raters,
)
from vtprune.models.tiny import TINY_TYPES, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "release_sparsevlm.json"


@functools.cache
def _release() -> dict:
    return json.loads(FIXTURE.read_text())


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


# -- exact to the release ----------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(5))
def test_release_raters_kept_and_recycled(index):
    """Gumpest/SparseVLMs (commit in the fixture) run on these inputs: same raters, kept tokens, recycled
    tokens, cluster centres and merged values."""
    data = _release()
    assert data["commit"] == "26a5f48813c46cd1c7364160354e7fdd3febaa67"
    case = data["cases"][index]
    expected = case["expected"]
    prefix, nv = case["prefix"], case["visual"]
    start = prefix + nv
    embeds = torch.tensor(case["embeds"])
    raters = text_raters(embeds[prefix:start], embeds[start:]).nonzero().flatten()
    assert raters.tolist() == expected["raters"]

    query, key = torch.tensor(case["query"])[None], torch.tensor(case["key"])[None]
    positions = (raters + start)[None]
    relevance = visual_attention_scores(query[:, :, positions[0]], key, query_positions=positions)[0, prefix:start]
    kept = torch.topk(relevance, case["keep"]).indices
    assert sorted(kept.tolist()) == expected["kept"]

    deleted = torch.ones(nv, dtype=torch.bool)
    deleted[kept] = False
    slots = deleted.nonzero().flatten()
    hidden = torch.tensor(case["hidden"])[prefix:start]
    jitter = torch.tensor(expected["jitter"]) * 1e-6  # the release's random density noise, recorded
    centres, merged = recycle_deleted(hidden[slots], relevance[slots], jitter=jitter)
    assert slots[centres].tolist() == expected["centres"]  # the release's order: by centre score
    torch.testing.assert_close(merged, torch.tensor(expected["merged"]), atol=2e-5, rtol=0)
    recycled, _ = recycle_count(slots.numel())
    assert recycled == len(expected["recycled"])


@pytest.mark.parametrize("index", range(5))
def test_release_rank_rule_of_the_first_release(index):
    """``count="rank"``: the first release's ``attn_postprocess_rank`` (91fb6d9, scale 13.5) on the same inputs."""
    case = _release()["cases"][index]
    prefix, nv = case["prefix"], case["visual"]
    start = prefix + nv
    embeds = torch.tensor(case["embeds"])
    raters = text_raters(embeds[prefix:start], embeds[start:]).nonzero().flatten()
    query, key = torch.tensor(case["query"])[None], torch.tensor(case["key"])[None]
    positions = (raters + start)[None]
    valid = torch.ones(1, key.shape[2], dtype=torch.bool)
    rows = rater_rows(query[:, :, positions[0]], key, positions, valid, key.shape[-1] ** -0.5)[0]
    count = rank_count(rows[:, prefix:start], nv)
    relevance = rows[:, prefix:start].mean(dim=0)
    assert sorted(torch.topk(relevance, count).indices.tolist()) == case["expected"]["rank_kept"]


def test_rank_count_by_hand():
    # rank 2 of a 2 x 10 matrix: int(2 * 13.5) = 27, capped at N - 1 = 9; with N = 40: 27; rank = N: keep all.
    rows = torch.tensor([[1.0, 0.0] + [0.5] * 8, [0.0, 1.0] + [0.25] * 8])
    assert rank_count(rows, 10) == 9
    assert rank_count(torch.cat([rows, torch.zeros(2, 30)], dim=1), 40) == 27
    assert rank_count(torch.eye(3), 3) == 3


def test_rank_rule_schedule_and_batch():
    stages = sparsevlm_schedule(32, 0.25, count="rank")
    assert [s.layer for s in stages] == [3, 7, 16, 20] and all(s.keep == 1.0 for s in stages)
    model, processor = _model("qwen2_vl")
    samples = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 80, 2)])]
    batch = tiny_inputs(processor, "qwen2_vl", samples)
    with vtprune.apply(model, "sparsevlm", keep=0.3, count="rank") as handle, torch.no_grad():
        model(**batch)
        stats = handle.last_stats
        for row, sample in enumerate(samples):
            model(**tiny_inputs(processor, "qwen2_vl", [sample]))
            assert handle.last_stats.kept_indices == [stage[row:row + 1] for stage in stats.kept_indices]


# -- hand-computed -----------------------------------------------------------------------------------------
def test_text_raters_by_hand():
    # one visual token v = (1, 0); text t0 = (2, 0), t1 = (0, 0), t2 = (-2, 0): logits 2, 0, -2 -> softmax
    # (0.867, 0.117, 0.016), mean 1/3: only t0 is a rater.
    visual = torch.tensor([[1.0, 0.0]])
    text = torch.tensor([[2.0, 0.0], [0.0, 0.0], [-2.0, 0.0]])
    assert text_raters(visual, text).tolist() == [True, False, False]
    # two visual tokens pulling to opposite ends: softmax rows (0.867, .117, .016) and (.016, .117, .867), mean
    # (0.441, 0.117, 0.441): t0 and t2.
    visual = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert text_raters(visual, text).tolist() == [True, False, True]


def test_recycle_count_is_the_release_rule():
    assert recycle_count(0) == (0, 0)
    assert recycle_count(1) == (1, 1)  # int(0.3) + 1 = 1, int(1 / 10) + 1 = 1
    assert recycle_count(266) == (80, 9)  # 576 - 300 deleted at the first stage of the 192 preset
    assert recycle_count(30) == (10, 2)


def test_dpc_knn_two_obvious_groups():
    # Two tight groups far apart: one centre in each, every token joins its own group's centre.
    x = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.12], [5.0, 5.0], [5.1, 5.0], [5.0, 5.13]])
    centres, assign = dpc_knn(x, 2)
    assert sorted(assign[centres].tolist()) == [0, 1]
    group = assign.tolist()
    assert group[0] == group[1] == group[2] != group[3] == group[4] == group[5]
    means = cluster_means(x, assign, 2)
    torch.testing.assert_close(means[assign[0]], x[:3].mean(dim=0), atol=1e-5, rtol=0)


def test_dpc_knn_density_and_delta_by_hand():
    # 1-D points 0, 1, 3 (C = 1): 2 nearest incl. itself -> d^2 means (0.5, 0.5, 2): density e^-0.5, e^-0.5,
    # e^-2. Nobody is denser than 0 or 1 (equal), so both get delta = max distance 3; point 2: nearest denser
    # is 1 at 2. Score 3 e^-0.5 = 1.82 (0 and 1), 2 e^-2 = 0.27: the centres are 0 and 1 (2 joins 1).
    x = torch.tensor([[0.0], [1.0], [3.0]])
    centres, assign = dpc_knn(x, 2)
    assert sorted(centres.tolist()) == [0, 1]
    assert assign[2] == assign[1]


def test_schedule_release_layers_and_presets():
    stages = sparsevlm_schedule(32, 110 / 576)
    assert [s.layer for s in stages] == [3, 7, 16]
    assert [round(s.keep * 576) for s in stages] == [300, 200, 110]
    for retain, counts in PRESETS.items():
        assert [round(s.keep * 576) for s in sparsevlm_schedule(32, 0.5, retain)] == list(counts)
    # keep = 64/576: |log(64/110)| = 0.54 < |log(64/36)| = 0.58, so the 192 preset's shape, ending at keep.
    stages = sparsevlm_schedule(32, 64 / 576)
    assert stages[-1].keep == pytest.approx(64 / 576)
    assert stages[0].keep == pytest.approx(64 / 576 * 300 / 110)
    # keep = 30/576: |log(30/26)| = 0.14 < |log(30/36)| = 0.18: the 96 preset's shape.
    assert sparsevlm_schedule(32, 30 / 576)[0].keep == pytest.approx(30 / 576 * 238 / 26)
    assert [s.keep for s in sparsevlm_schedule(32, 1.0)] == [1.0, 1.0, 1.0]


def test_schedule_scales_and_merges_colliding_stages():
    assert stage_layers(28) == [3, 6, 14]
    assert stage_layers(4) == [2, 3]  # 2, 6, 15 of 32 -> 1, 1, 2: moved on, the third past the last layer
    stages = sparsevlm_schedule(4, 0.25)
    assert [s.layer for s in stages] == [2, 3] and stages[-1].keep == 0.25


def test_options_fail_early():
    with pytest.raises(ValueError, match="retain=100"):
        vtprune.methods.resolve("sparsevlm", {"retain": 100})
    with pytest.raises(ValueError, match="recycle_ratio"):
        vtprune.methods.resolve("sparsevlm", {"recycle_ratio": 1.5})


# -- the merge step ----------------------------------------------------------------------------------------
def test_merge_keeps_cluster_means_in_centre_slots():
    scorer = vtprune.methods.resolve("sparsevlm")
    batch, length, dim = 2, 9, 3
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, length, dim, generator=generator)
    scores = torch.rand(batch, length, generator=generator)
    visual = torch.zeros(batch, length, dtype=torch.bool)
    visual[:, 1:8] = True
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, 0] = False  # a padded slot
    visual[1, 0] = False
    kept = valid & ~visual
    kept[0, [2, 5]] = True
    kept[1, [3]] = True
    ctx = SimpleNamespace(visual=visual, valid=valid)
    new_kept, new_hidden = scorer.merge(ctx, kept, scores, hidden)
    for row in range(batch):
        slots = (visual[row] & valid[row] & ~kept[row]).nonzero().flatten()
        centres, merged = recycle_deleted(hidden[row, slots], scores[row, slots])
        assert new_kept[row].sum() == kept[row].sum() + centres.numel()
        torch.testing.assert_close(new_hidden[row, slots[centres]], merged)
        untouched = torch.ones(length, dtype=torch.bool)
        untouched[slots[centres]] = False
        assert torch.equal(new_hidden[row, untouched], hidden[row, untouched])
    same_kept, same_hidden = vtprune.methods.resolve("sparsevlm", {"recycle": False}).merge(ctx, kept, scores, hidden)
    assert same_kept is kept and same_hidden is hidden


# -- a batch with different questions equals each sample alone ---------------------------------------------
@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_batch_equals_each_sample_alone_with_recycling(model_type):
    model, processor = _model(model_type)
    samples = [("what color is the circle?", [random_image(120, 90, 1)]),
               ("how many squares are there in the picture?", [random_image(64, 80, 2)])]
    batch = tiny_inputs(processor, model_type, samples)
    with vtprune.apply(model, "sparsevlm", keep=0.3) as handle, torch.no_grad():
        logits = model(**batch).logits
        stats = handle.last_stats
        valid = batch["attention_mask"].bool()
        for row, sample in enumerate(samples):
            alone = tiny_inputs(processor, model_type, [sample])
            alone_logits = model(**alone).logits
            assert handle.last_stats.kept_indices == [stage[row:row + 1] for stage in stats.kept_indices]
            torch.testing.assert_close(alone_logits[0, -1], logits[row][valid[row]][-1], atol=1e-4, rtol=0)
    # recycling keeps k + clusters at the first stage (k: the plain top-k, recycle=False)
    with vtprune.apply(model, "sparsevlm", keep=0.3, recycle=False) as handle, torch.no_grad():
        model(**batch)
        plain = handle.last_stats.kept[0]
    total = handle.adapter.visual_mask(batch["input_ids"]).sum(dim=1).tolist()
    assert stats.kept[0] == [k + recycle_count(n - k)[1] for k, n in zip(plain, total, strict=True)]


def test_dpc_knn_ties_without_jitter_go_to_the_earlier_token():
    # One cluster: every density is exp(0) = 1 (the nearest is the token itself). Without the release's random
    # jitter the earliest token (the most relevant, in recycling order) is the densest and the centre.
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    centres, assign = dpc_knn(x, 1)
    assert centres.tolist() == [0] and assign.tolist() == [0, 0, 0]
    centres, _ = dpc_knn(x, 1, jitter=torch.tensor([0.0, 0.0, 1e-6]))
    assert centres.tolist() == [2]


def test_vllm_serve_refuses_sparsevlm_at_start_up_in_one_line(cli):
    code, _, err = cli("serve", "--method", "sparsevlm")
    assert code == 2 and "'sparsevlm' is not available in the vLLM plugin" in err and "merge step" in err
    assert err.count("\n") == 1


def test_parity_release_compacts_positions_on_llava_and_is_refused_on_mrope():
    model, processor = _model("llava")
    batch = tiny_inputs(processor, "llava", [("what color?", [random_image(120, 90, 1)])])
    with vtprune.apply(model, "sparsevlm", keep=0.3, parity="release") as handle, torch.no_grad():
        model(**batch)
        assert handle.plan.positions == "compact" and len(handle.last_stats.kept) == 2
    with pytest.raises(ValueError, match="M-RoPE"):
        vtprune.wrap(_model("qwen2_vl")[0], "sparsevlm", keep=0.3, parity="release")


def test_parity_release_debias_is_the_released_patch_first_stage_only():
    model, processor = _model("llava")
    batch = tiny_inputs(processor, "llava", [("what color?", [random_image(120, 90, 1)])])
    with vtprune.apply(model, "sparsevlm+debias", keep=0.3, parity="release") as handle, torch.no_grad():
        model(**batch)
        scorer = handle.scorer
        assert scorer.stages == (0,) and scorer.debiaser.tau == 0.5 and scorer.debiaser.default.sigma == 1.95
        assert len(handle.last_stats.kept) == 2


def test_stage_keeps_the_raters_top_tokens_of_the_models_own_attention():
    """The engine's stage before layer 2 on tiny LLaVA keeps the top visual tokens by the raters' attention that
    the unwrapped model itself returns at layer 1 (eager ``output_attentions``), raters chosen on its layer-0
    input (``hidden_states[0]``): independent of the engine's q/k recomputation."""
    model, processor = tiny_model("llava", "eager", image_size=112)
    batch = tiny_inputs(processor, "llava", [("how many squares are there in the picture?", [random_image(120, 90, 3)])])
    with torch.no_grad():
        out = model(**batch, output_attentions=True, output_hidden_states=True)
    visual = (batch["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    text = torch.arange(int(visual.max()) + 1, batch["input_ids"].shape[1])
    embeds = out.hidden_states[0][0]
    raters = text[text_raters(embeds[visual], embeds[text])]
    relevance = out.attentions[1][0].mean(dim=0)[raters][:, visual].mean(dim=0)
    expected = sorted(torch.topk(relevance, visual.numel() // 2).indices.tolist())
    with vtprune.apply(model, "sparsevlm", schedule="2:0.5", recycle=False) as handle, torch.no_grad():
        model(**batch)
        assert handle.last_stats.kept_indices[0][0] == expected
