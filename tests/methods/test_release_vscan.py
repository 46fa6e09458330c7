"""VScan: the tower scans, the merge and the LLM stage equal the authors' release on fixed inputs; window and
schedule rules by hand; a batch with different questions equal to each sample alone; vLLM refuses it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from vtprune.kernels import visual_attention_scores

import vtprune
from vtprune.methods.vscan import global_local_scan, nearest_merge, vscan_schedule, window_ids, window_select
from vtprune.models.tiny import TINY_TYPES, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "release_vscan.json"
TOWER_CASES = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0)]


@functools.cache
def _release() -> dict:
    return json.loads(FIXTURE.read_text())


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


# -- exact to the release ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("case", "run"), TOWER_CASES)
def test_release_tower_scans_and_merge(case, run):
    """Tencent/SelfEvolvingAgent VScan (commit in the fixture): LLaVA's window_cls_selection (CLIP, 24 x 24, 6 x 6
    windows, per-window top-k) and Qwen2.5-VL's window_selection (4 x 4 windows, greedy), the global scan and
    token_merging, run on these inputs."""
    data = _release()
    assert data["commit"] == "a82450e1b5e15070bee79ee8b79f8d9a97cb85f7"
    tower = data["tower"][case]
    expected = tower["runs"][run]
    shallow, deep = torch.tensor(tower["shallow"]).float(), torch.tensor(tower["deep"]).float()
    windows, count = window_ids(tower["h"], tower["w"], 1, tower["window"])
    rule = "topk" if tower["family"] == "clip" else "greedy"
    kept = global_local_scan(shallow, deep, windows, count, expected["count"], 0.5, rule)
    local = len(expected["local"])
    assert kept[:local].tolist() == expected["local"]
    assert kept[local:].tolist() == expected["global"]
    assert sorted(kept.tolist()) == expected["kept"]
    mask = torch.zeros(shallow.numel(), dtype=torch.bool)
    mask[kept] = True
    merged = nearest_merge(torch.tensor(tower["features"]), mask)
    torch.testing.assert_close(merged[mask], torch.tensor(expected["merged"]), atol=2e-5, rtol=0)


@pytest.mark.parametrize("run", range(4))
def test_greedy_rule_equals_the_clip_release_where_windows_divide_the_count(run):
    tower = _release()["tower"][0]
    expected = tower["runs"][run]
    windows, count = window_ids(24, 24, 1, 6)
    kept = global_local_scan(torch.tensor(tower["shallow"]).float(), torch.tensor(tower["deep"]).float(), windows,
                             count, expected["count"])
    if expected["count"] // 2 % 16 == 0:
        assert sorted(kept.tolist()) == expected["kept"]
    else:  # 100: 50 local picks do not divide over 16 windows; the release keeps 48 + 50 = 98, vtprune 50 + 50
        assert kept.numel() == expected["count"] and len(expected["kept"]) == 98


@pytest.mark.parametrize("index", range(2))
def test_release_llm_stage_last_token_attention(index):
    case = _release()["llm"][index]
    query, key = torch.tensor(case["query"])[None], torch.tensor(case["key"])[None]
    last = case["prefix"] + case["visual"] + case["text"] - 1
    scores = visual_attention_scores(query[:, :, [last]], key, query_positions=torch.tensor([[last]]))[0]
    visual = scores[case["prefix"]: case["prefix"] + case["visual"]]
    assert sorted(torch.topk(visual, case["keep"]).indices.tolist()) == case["kept"]


# -- hand-computed -----------------------------------------------------------------------------------------
def test_window_ids_fold_the_rest_into_the_last_window():
    # 9 x 7 grid, windows of 4: 2 window rows (rows 8 join the second), 1 window column (7 columns).
    ids, count = window_ids(9, 7, 1, 4)
    assert count == 2
    grid = ids.view(9, 7)
    assert grid[:4].unique().tolist() == [0] and grid[4:].unique().tolist() == [1]
    # 2 frames of 2 x 2 with windows of 1: 4 windows per frame, the second frame's ids after the first's.
    ids, count = window_ids(2, 2, 2, 1)
    assert count == 4 and ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_window_select_rules_by_hand():
    values = torch.tensor([9.0, 8.0, 7.0, 1.0, 2.0, 3.0])
    windows = torch.tensor([0, 0, 0, 1, 1, 1])
    # greedy, 3 tokens in 2 windows: at most 2 per window -> 9, 8 (window 0 full), then 3 (window 1).
    assert window_select(values, windows, 3, 2, "greedy").tolist() == [0, 1, 5]
    # topk: floor(3 / 2) = 1 per window -> 9 and 3.
    assert window_select(values, windows, 3, 2, "topk").tolist() == [0, 5]


def test_global_scan_skips_the_local_picks():
    shallow = torch.tensor([5.0, 1.0, 2.0, 3.0])
    deep = torch.tensor([9.0, 8.0, 1.0, 2.0])
    windows = torch.tensor([0, 0, 1, 1])
    # 2 kept: 1 local (greedy, limit 1: token 0), 1 global: the best deep among the rest is token 1.
    assert global_local_scan(shallow, deep, windows, 2, 2).tolist() == [0, 1]


def test_nearest_merge_by_hand():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [2.0, 0.2], [0.1, 3.0]])
    kept = torch.tensor([True, True, False, False, False])
    merged = nearest_merge(hidden, kept)
    torch.testing.assert_close(merged[0], torch.tensor([(1.0 + 0.9 + 2.0) / 3, (0.0 + 0.1 + 0.2) / 3]))
    torch.testing.assert_close(merged[1], torch.tensor([0.05, 2.0]))
    assert torch.equal(merged[2:], hidden[2:])


def test_schedule_tower_then_middle_layer():
    stages = vscan_schedule(32, 32 / 576)
    assert [s.layer for s in stages] == [0, 16]
    assert round(stages[0].keep * 576) == 96 and round(stages[1].keep * 576) == 32
    assert [s.layer for s in vscan_schedule(28, 0.1)] == [0, 14]
    assert vscan_schedule(32, 0.5)[0].keep == 1.0


def test_options_fail_early():
    for options, match in (({"llm_ratio": 0}, "llm_ratio"), ({"rule": "auto"}, "rule='auto'"),
                           ({"window": 0}, "window"), ({"global_ratio": 2}, "global_ratio")):
        with pytest.raises(ValueError, match=match):
            vtprune.methods.resolve("vscan", options)


# -- models ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_batch_equals_each_sample_alone_with_merging(model_type):
    model, processor = _model(model_type)
    samples = [("what color is the circle?", [random_image(120, 90, 1)]),
               ("how many squares are there in the picture?", [random_image(64, 80, 2)])]
    batch = tiny_inputs(processor, model_type, samples)
    with vtprune.apply(model, "vscan", keep=0.2) as handle, torch.no_grad():
        logits = model(**batch).logits
        stats = handle.last_stats
        assert [s.layer for s in handle.stages][0] == 0
        valid = batch["attention_mask"].bool()
        for row, sample in enumerate(samples):
            alone_logits = model(**tiny_inputs(processor, model_type, [sample])).logits
            assert handle.last_stats.kept_indices == [stage[row:row + 1] for stage in stats.kept_indices]
            torch.testing.assert_close(alone_logits[0, -1], logits[row][valid[row]][-1], atol=1e-4, rtol=0)
    with vtprune.apply(model, "vscan", keep=0.2, recycle=False) as handle, torch.no_grad():
        plain = model(**batch).logits
        # merging changes the tower stage's values, not its selection (the LLM stage then scores other values)
        assert handle.last_stats.kept_indices[0] == stats.kept_indices[0]
    assert not torch.allclose(plain[valid], logits[valid])


def test_parity_release_compacts_positions_on_llava():
    model, processor = _model("llava")
    batch = tiny_inputs(processor, "llava", [("what color?", [random_image(120, 90, 1)])])
    with vtprune.apply(model, "vscan", keep=0.2, parity="release") as handle, torch.no_grad():
        model(**batch)
        assert handle.plan.positions == "compact" and len(handle.last_stats.kept) == 2


def test_vllm_serve_refuses_vscan_at_start_up_in_one_line(cli):
    code, _, err = cli("serve", "--method", "vscan")
    assert code == 2 and "'vscan' is not available in the vLLM plugin" in err
    assert err.count("\n") == 1


def test_tower_stage_keeps_the_scans_of_the_towers_own_attention():
    """The engine's tower stage on tiny LLaVA (8 x 8 CLIP grid, windows 2 x 2 -> 16) keeps what the pure scans
    select from the CLS rows the vision tower itself returns (``output_attentions``; independent of tower.py)."""
    model, processor = tiny_model("llava", "eager", image_size=112)
    batch = tiny_inputs(processor, "llava", [("what color?", [random_image(120, 90, 1)])])
    with torch.no_grad():
        out = model.model.vision_tower(batch["pixel_values"], output_attentions=True)
    cls = [a[0, :, 0, 1:].mean(dim=0) for a in out.attentions]  # [64] per layer: shallow 1 (option), deep 0
    windows, count = window_ids(8, 8, 1, 2)
    expected = sorted(global_local_scan(cls[1], cls[0], windows, count, 32).tolist())
    with vtprune.apply(model, "vscan", schedule="0:0.5", shallow_layer=1) as handle, torch.no_grad():
        model(**batch)
        assert handle.last_stats.kept_indices[0][0] == expected
