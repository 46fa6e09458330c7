"""``parity="release"``: the releases' kept counts (hand-computed), position policy, debiasing patches and the
wrap-time refusals."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import vtprune
from vtprune.config import Stage, keep_count, truncated_count
from vtprune.methods.base import Scorer
from vtprune.methods.debias import FASTV_RELEASE, Debiased, Debiaser, Trend, release_debiased, set_image_sizes
from vtprune.methods.fastv import FastV
from vtprune.methods.pdrop import PyramidDrop
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model
from vtprune.plan import Plan
from vtprune.scoring import ScoreContext

torch.set_num_threads(1)


@functools.cache
def _model(model_type: str = "llava"):
    return tiny_model(model_type, "sdpa", image_size=112)


def _inputs(model_type: str = "llava", seed: int = 1):
    return tiny_inputs(_model(model_type)[1], model_type, [("what color is the circle?", [random_image(120, 90, seed)])])


def _run(method: str, keep: float, records: list | None = None, model_type: str = "llava", **options):
    model, _ = _model(model_type)
    with torch.no_grad(), vtprune.apply(model, method, keep=keep, **options) as handle:
        if records is not None:
            handle.observe(records.append)
        logits = model(**_inputs(model_type)).logits
    return handle, logits


# -- counts --------------------------------------------------------------------------------------------------
def test_truncated_and_rounded_counts_by_hand():
    assert 100 * 0.29 < 29  # 28.999999999999996: int() gives 28, as the releases' int(N * ratio)
    assert (truncated_count(0.29, 100), keep_count(0.29, 100)) == (28, 29)
    assert (truncated_count(0.5, 9), keep_count(0.5, 9)) == (4, 5)  # 4.5: truncation vs round half up
    assert (truncated_count(0.5, 576), truncated_count(0.25, 576), truncated_count(0.125, 576)) == (288, 144, 72)
    assert truncated_count(0.001, 64) == 1 and truncated_count(1.0, 64) == 64  # at least 1, at most n
    plan = Plan(scorer=FastV(), stages=(Stage(1, 0.45), Stage(2, 0.2)), counting="truncate")
    assert plan.kept_counts([64, 10]) == [[28, 4], [12, 2]]  # 28.8, 4.5, 12.8, 2.0


def test_release_counts_through_the_engine():
    """64 visual tokens: 0.45 / 0.2 / 0.125 of them are 28.8 / 12.8 / 8, kept as 28 / 12 / 8 (release) or 29 / 13 / 8."""
    schedule = "1:0.45,2:0.2,3:0.125"
    release, _ = _run("pdrop", 0.125, schedule=schedule, parity="release")
    default, _ = _run("pdrop", 0.125, schedule=schedule)
    assert release.last_stats.kept == [[28], [12], [8]]
    assert default.last_stats.kept == [[29], [13], [8]]
    transprune, _ = _run("transprune", 0.125, schedule=schedule, parity="release")
    assert transprune.last_stats.kept == [[28], [12], [8]]


def test_default_schedules_reach_the_released_ratios():
    """keep 0.125: PyramidDrop's LLaVA-1.5 ratios 0.5 / 0.25 / 0.125, TransPrune-High's 0.875 / 0.625 / 0.125."""
    handle, _ = _run("pdrop", 0.125, parity="release")
    assert [s.keep for s in handle.stages] == [0.5, 0.25, 0.125]
    assert handle.last_stats.kept == [[32], [16], [8]]
    handle, _ = _run("transprune", 0.125, parity="release")
    assert [s.keep for s in handle.stages] == [0.875, 0.625, 0.125]
    assert handle.last_stats.kept == [[56], [40], [8]]


# -- positions -------------------------------------------------------------------------------------------------
def test_release_positions_are_the_compacted_ones():
    """PyramidDrop's release = truncated counts + compacted positions: the same model output as vtprune's
    positions='compact' with keeps whose round-half-up counts are the truncated ones (28 / 12 / 8)."""
    release, logits = _run("pdrop", 0.125, schedule="1:0.45,2:0.2,3:0.125", parity="release")
    assert release.plan.positions == "compact"
    compact, same = _run("pdrop", 0.125, schedule="1:0.4375,2:0.1875,3:0.125", positions="compact")
    assert compact.last_stats.kept_indices == release.last_stats.kept_indices
    torch.testing.assert_close(logits, same, atol=0, rtol=0, equal_nan=True)  # NaN: pruned visual positions
    original, other = _run("pdrop", 0.125, schedule="1:0.4375,2:0.1875,3:0.125")
    assert not torch.equal(other.nan_to_num(), logits.nan_to_num())  # the compaction is what differs
    fastv, _ = _run("fastv", 0.25, parity="release")
    assert fastv.plan.positions == "original" and fastv.last_stats.kept == [[16]]  # R = 16 of 64 exactly


# -- debiasing patches ---------------------------------------------------------------------------------------
def test_fastv_released_cubic_by_hand():
    trend = FASTV_RELEASE.trend
    x = torch.tensor([0.0, 0.5, 0.75])
    expected = torch.tensor([1.0, 1 + 1.7368 * 0.5 - 4.8432 * 0.25 + 4.9097 * 0.125,
                             1 + 1.7368 * 0.75 - 4.8432 * 0.5625 + 4.9097 * 0.421875])
    torch.testing.assert_close(trend(x), expected)
    weights = Debiaser(default=trend).weights(torch.tensor([[-1, 0, 288, 432]]), torch.tensor([576]), 1)
    torch.testing.assert_close(weights, torch.tensor([[1.0, *(1 / expected).tolist()]]))
    # Spec 2.2 quotes the released weight.npy as w = 0.97 / 0.83 / 0.78 / 0.59 / 0.38 at rows 0 / 6 / 12 / 18 / 23
    # of LLaVA-1.5's 24 x 24 grid, to two decimals (row means of 1 / f(i / 576): 0.969 0.825 0.779 0.586 0.376).
    all_weights = Debiaser(default=trend).weights(torch.arange(576)[None], torch.tensor([576]), 1)[0].view(24, 24)
    rows = all_weights.mean(dim=1)[[0, 6, 12, 18, 23]]
    torch.testing.assert_close(rows, torch.tensor([0.97, 0.83, 0.78, 0.59, 0.38]), atol=0.006, rtol=0)


def test_fastv_release_debias_scores_and_lowered_count():
    plain, debiased = [], []
    _run("fastv", 0.5, plain, parity="release")
    _run("fastv+debias", 0.5, debiased, parity="release")
    slots = plain[0].visual[0]
    x = plain[0].ordinal[0, slots].float() / 64
    torch.testing.assert_close(debiased[0].scores[0, slots], plain[0].scores[0, slots] / FASTV_RELEASE.trend(x))
    # 120x90 padded to a square: 14 px of 112 top and bottom = rows 0 and 7 of the 8 x 8 grid (16 tokens).
    model, _ = _model()
    inputs = _inputs()
    for parity, expected in (("release", 48), ("default", 58)):  # keep 0.9: R = 58 > 48 unpadded tokens
        with torch.no_grad(), vtprune.apply(model, "fastv+debias", keep=0.9, parity=parity) as handle:
            set_image_sizes(handle, [(90, 120)])
            model(**inputs)
        kept = handle.last_stats.kept_indices[0][0]
        assert len(kept) == expected
        if parity == "release":
            assert sorted(kept) == list(range(8, 56))


class _Raw(Scorer):
    """Returns fixed scores through the attention filter, as an attention scorer does."""

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        raw = torch.tensor([[0.0, 4.0, 4.0, 4.0, 4.0]])
        return raw if ctx.attention_filter is None else ctx.attention_filter(ctx, raw)


def _ctx(stage_index: int) -> ScoreContext:
    ordinal = torch.tensor([[-1, 0, 1, 2, 3]])
    return ScoreContext(hidden=torch.zeros(1, 5, 2), layer_index=1, layer=None, position_embeddings=None,
                        valid=torch.ones(1, 5, dtype=torch.bool), visual=ordinal >= 0, ordinal=ordinal,
                        num_visual=torch.tensor([4]), segments=[[]], adapter=None, stage_index=stage_index)


def test_pdrop_release_debiases_the_first_stage_only(tmp_path):
    release = vtprune.methods.debias.PDROP_RELEASE
    scorer = release_debiased(Debiased(inner=_Raw(), option=True), release)
    w = torch.exp(-1.9 * torch.tensor([0.0, 0.25, 0.5, 0.75]))
    torch.testing.assert_close(scorer.score(_ctx(0))[0, 1:], 4.0 * w)
    assert scorer.score(_ctx(1)).tolist() == [[0.0, 4.0, 4.0, 4.0, 4.0]]
    assert scorer.debiaser.tau == 0.01
    handle, _ = _run("pdrop+debias", 0.25, parity="release")
    assert handle.scorer.stages == (0,) and isinstance(handle.scorer.inner, PyramidDrop)
    # A calibration file keeps its fitted trend (the release's per-benchmark weights); tau stays the release's.
    file = tmp_path / "cal.json"
    file.write_text(json.dumps({"format": "vtprune-debias-calibration", "tau": 0.5, "layers": {"1": {"sigma": 0.7}}}))
    fitted = release_debiased(Debiased(inner=_Raw(), option=str(file)), release)
    assert fitted.debiaser.trend(1).sigma == 0.7 and fitted.debiaser.tau == 0.01


def test_default_debias_is_unchanged():
    handle, _ = _run("pdrop+debias", 0.25)
    assert handle.scorer.stages is None and handle.scorer.debiaser.default == Trend()
    assert handle.scorer.debiaser.tau == 0.5


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, model_type, match", [
    ("vflowopt", "llava", "not available for method 'vflowopt'.*methods with one: cdpruner, fastv, hiprune, .*visionzip, vispruner, vscan\\)"),
    ("random", "llava", "not available for method 'random'"),
    ("transprune+debias", "llava", "patches FastV and PyramidDrop, not 'transprune'"),
    ("pdrop", "qwen2_vl", "compacts position ids .* qwen2_vl uses 3-D M-RoPE positions"),
    ("transprune", "qwen2_5_vl", "no release exists and vtprune does not renumber"),
])
def test_release_refusals_at_wrap_time(method, model_type, match):
    model, _ = _model(model_type)
    with pytest.raises(ValueError, match=match):
        vtprune.wrap(model, method, keep=0.25, parity="release")
    assert not hasattr(model, "_vtprune_handle")


def test_bad_parity_values():
    with pytest.raises(ValueError, match="parity must be 'default'"):
        vtprune.wrap(_model()[0], "fastv", keep=0.25, parity="paper")
    with pytest.raises(ValueError, match="keeps original position ids"):
        vtprune.wrap(_model()[0], "fastv", keep=0.25, parity="release", positions="compact")
    handle = vtprune.wrap(_model("qwen2_vl")[0], "fastv", keep=0.25, parity="release")  # FastV's rule fits M-RoPE
    assert handle.config.positions == "original"
    handle.remove()
