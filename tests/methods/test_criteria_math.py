"""The formulas of the importance criteria on small hand-computed examples (pure tensor functions)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from vtprune.adapters.base import VisualSegment
from vtprune.adapters.llava import square_padding_fraction

from vtprune.config import Stage
from vtprune.methods import budget as B
from vtprune.methods.debias import (
    Debiaser,
    Trend,
    binned_curve,
    check_debias_option,
    debias,
    fit_exponential,
    padding_keep_mask,
    relative_positions,
)
from vtprune.methods.entropy import denormalize, patch_entropy
from vtprune.methods.functional import lowest_kept, masked_softmax, normalise_alive, recycle, ttv, ttv_terms
from vtprune.methods.schedules import transprune as transprune_stages
from vtprune.methods.vit import cell_ids, context_relevance

torch.set_num_threads(1)


# -- debiasing ---------------------------------------------------------------------------------------------
def test_debias_hand_example():
    scores = torch.tensor([[9.0, 1.0, 2.0, 3.0, 4.0]])  # slot 0 is text
    ordinal = torch.tensor([[-1, 0, 1, 2, 3]])
    debiaser = Debiaser(default=Trend(sigma=math.log(2.0), mu=1.0), tau=0.5)
    weights = debiaser.weights(ordinal, torch.tensor([4]), layer_index=1)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 2 ** -0.25, 2 ** -0.5, 2 ** -0.75]]))
    mask = padding_keep_mask(ordinal, [torch.tensor([0.0, 0.6, 0.5, 0.0])], tau=0.5)
    assert mask.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0]]
    out = debias(scores, weights, mask)
    torch.testing.assert_close(out, torch.tensor([[9.0, 1.0, 0.0, 3 * 2 ** -0.5, 4 * 2 ** -0.75]]))


@pytest.mark.parametrize("sigma", [0.0, 0.9, 1.9, -0.7])
def test_debias_removes_exponential_trend_exactly(sigma):
    n = 576
    ordinal = torch.arange(n)[None]
    x = relative_positions(ordinal, torch.tensor([n]))
    biased = 0.37 * 2.5 * torch.exp(sigma * x)  # a flat score 0.37 times the trend mu * exp(sigma x)
    debiaser = Debiaser(default=Trend(sigma=sigma, mu=2.5))
    flat = debias(biased, debiaser.weights(ordinal, torch.tensor([n]), 0), torch.ones_like(biased))
    torch.testing.assert_close(flat, torch.full_like(flat, 0.37))


def test_table_trend_removes_its_curve_and_fit_recovers_parameters():
    xs, ys = [0.0, 0.5, 1.0], [1.0, 3.0, 2.0]
    ordinal = torch.arange(10)[None]
    x = relative_positions(ordinal, torch.tensor([10]))
    curve = torch.where(x <= 0.5, 1.0 + 4.0 * x, 3.0 - 2.0 * (x - 0.5))
    debiaser = Debiaser(default=Trend(xs=xs, ys=ys))
    flat = debias(5.0 * curve, debiaser.weights(ordinal, torch.tensor([10]), 0), torch.ones_like(curve))
    torch.testing.assert_close(flat, torch.full_like(flat, 5.0))
    grid = torch.linspace(0, 0.99, 200)
    mu, sigma, r2 = fit_exponential(grid, 0.8 * torch.exp(1.9 * grid))
    assert abs(mu - 0.8) < 1e-6 and abs(sigma - 1.9) < 1e-6 and r2 > 1 - 1e-9


def test_binned_curve_hand_example():
    x = torch.tensor([0.0, 0.1, 0.6, 0.7, 0.9])
    a = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0])
    centres, means, counts = binned_curve(x, a, bins=2)
    assert centres == [0.25, 0.75] and means == [2.0, 4.0] and counts == [2, 3]


def test_debias_option_validation(tmp_path):
    assert check_debias_option(True) is True and check_debias_option(False) is False
    with pytest.raises(ValueError, match="no such calibration file"):
        check_debias_option(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a vtprune debias calibration"):
        check_debias_option(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("name", ["random", "ttv", "vflowopt", "none"])
def test_debias_is_rejected_for_methods_without_attention(name):
    from vtprune.methods import Debiased, resolve

    with pytest.raises(ValueError, match="debias does not apply"):
        resolve(name, {"debias": True})
    for host in ("fastv", "pdrop", "transprune"):
        scorer = resolve(host, {"debias": True})
        assert isinstance(scorer, Debiased) and scorer.inner.name == host and scorer.name == f"{host}+debias"


# -- padding maps ------------------------------------------------------------------------------------------
def test_square_padding_marks_the_padded_rows():
    # 120 x 90 (w x h) on a 120-px square: 15 px bands top and bottom = exactly one 14-px row of 8 at 112 px.
    fraction = square_padding_fraction(height=90, width=120, side=8).view(8, 8)
    assert fraction[0].tolist() == [1.0] * 8 and fraction[7].tolist() == [1.0] * 8
    assert float(fraction[1:7].abs().max()) == 0.0
    tall = square_padding_fraction(height=100, width=50, side=4).view(4, 4)  # 25 px bands, cells of 25 px
    assert tall[:, 0].tolist() == [1.0] * 4 and tall[:, 3].tolist() == [1.0] * 4 and float(tall[:, 1:3].max()) == 0
    partial = square_padding_fraction(height=80, width=100, side=4).view(4, 4)  # 10 px bands, 25 px cells
    torch.testing.assert_close(partial[0], torch.full((4,), 0.4))
    torch.testing.assert_close(partial[3], torch.full((4,), 0.4))


@functools.cache
def _tiny(model_type: str):
    from vtprune.models.tiny import tiny_model

    return tiny_model(model_type, image_size=112)


def test_adapter_padding_fraction_per_family():
    from vtprune.adapters import get_adapter

    from vtprune.models.tiny import random_image, tiny_inputs

    model, processor = _tiny("llava")
    samples = [("q?", [random_image(120, 90, 0)]), ("q?", [random_image(64, 64, 1), random_image(50, 100, 2)])]
    inputs = tiny_inputs(processor, "llava", samples)
    adapter = get_adapter(model)
    assert adapter.padding_fraction(inputs["input_ids"], inputs) is None  # centre-crop processor: no padding
    padded = dict(inputs, vtprune_image_sizes=[(90, 120), (64, 64), (100, 50)])
    first, second = adapter.padding_fraction(inputs["input_ids"], padded)
    assert first.view(8, 8)[0].tolist() == [1.0] * 8 and float(first.view(8, 8)[1:7].max()) == 0.0
    assert float(second[:64].max()) == 0.0 and second[64:].view(8, 8)[:, 0].tolist() == [1.0] * 8
    qwen, qwen_processor = _tiny("qwen2_vl")
    q_inputs = tiny_inputs(qwen_processor, "qwen2_vl", [("q?", [random_image(120, 90, 0)])])
    assert get_adapter(qwen).padding_fraction(q_inputs["input_ids"], q_inputs) is None


def test_llava_next_padding_is_nearly_a_no_op():
    from vtprune.adapters import get_adapter

    from vtprune.models.tiny import random_image, tiny_inputs

    model, processor = _tiny("llava_next")
    inputs = tiny_inputs(processor, "llava_next", [("q?", [random_image(200, 90, 0)])])
    (fraction,) = get_adapter(model).padding_fraction(inputs["input_ids"], inputs)
    tiles = fraction[64:].view(8, 17)  # best resolution 112 x 224; image 101 px tall pasted at row 5
    torch.testing.assert_close(tiles[0, :16], torch.full((16,), 5 / 14))
    torch.testing.assert_close(tiles[7, :16], torch.full((16,), 6 / 14))
    assert float(fraction[:64].max()) == 0 and float(tiles[1:7].max()) == 0 and float(tiles[:, 16].max()) == 0


# -- TransPrune ------------------------------------------------------------------------------------------
def test_ttv_terms_and_softmax_hand_example():
    t_in = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [2.0, 0.0]]])
    t_out = torch.tensor([[[0.0, 2.0], [-1.0, 0.0], [1.0, 0.0]]])
    magnitude, direction = ttv_terms(t_in, t_out)
    torch.testing.assert_close(magnitude, torch.tensor([[2.0, 1.0, 0.5]]))
    torch.testing.assert_close(direction, torch.tensor([[1.0, 2.0, 0.0]]))
    _, absolute = ttv_terms(t_in, t_out, abs_cos=True)
    torch.testing.assert_close(absolute, torch.tensor([[1.0, 0.0, 0.0]]))
    valid = torch.tensor([[True, True, False]])
    e1, e2 = math.exp(1.0), math.exp(2.0)
    torch.testing.assert_close(ttv(magnitude, direction, valid), torch.tensor([[2 * e1 / (e1 + e2), e2 / (e1 + e2), 0.0]]))
    assert masked_softmax(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool)).tolist() == [[0.0, 0.0]]
    alive = torch.tensor([[False, True, True, True]])
    torch.testing.assert_close(normalise_alive(torch.tensor([[5.0, 1.0, 1.0, 2.0]]), alive, eps=0.0),
                               torch.tensor([[0.0, 0.25, 0.25, 0.5]]))


def test_transprune_schedule():
    assert transprune_stages(32, 0.125) == (Stage(7, 0.875), Stage(9, 0.625), Stage(12, 0.125))
    stages = transprune_stages(32, 0.25)
    assert [s.layer for s in stages] == [7, 9, 12] and stages[-1].keep == 0.25
    torch.testing.assert_close(torch.tensor([s.keep for s in stages]),
                               torch.tensor([1 - 0.125 * 0.75 / 0.875, 1 - 0.375 * 0.75 / 0.875, 0.25]))
    assert [s.layer for s in transprune_stages(28, 0.125)] == [6, 8, 10]
    assert [s.layer for s in transprune_stages(4, 0.25)] == [1, 2, 3]
    assert transprune_stages(2, 0.25) == (Stage(1, 0.25),)


# -- VFlowOpt ----------------------------------------------------------------------------------------------
def test_context_relevance_hand_example():
    attention = torch.tensor([[[0.1, 0.8, 0.1], [0.2, 0.6, 0.2], [0.3, 0.5, 0.2]]])  # received: 0.6, 1.9, 0.5
    torch.testing.assert_close(context_relevance(attention, 1.0), torch.tensor([[0.2, 0.6, 0.2]]))  # K = {1}
    both = context_relevance(attention, 0.55)  # K = {0, 1}: mean of rows 0 and 1
    torch.testing.assert_close(both, torch.tensor([[0.15, 0.7, 0.15]]))
    fallback = context_relevance(attention, 5.0)  # K empty: all queries
    torch.testing.assert_close(fallback, attention.mean(dim=1))


def test_patch_entropy_hand_example():
    rgb = torch.zeros(1, 3, 4, 8)
    rgb[..., :, 4:6] = 255.0  # right patch: half the pixels white -> 1 bit
    rgb[..., :2, 6:] = 255.0  # adds more white rows to the same patch: cols 4-5 all rows + cols 6-7 rows 0-1
    rgb2 = torch.zeros(1, 3, 4, 4)
    rgb2[0, :, 0] = 10.0
    rgb2[0, :, 1] = 20.0
    rgb2[0, :, 2] = 30.0
    entropy = patch_entropy(rgb, 4)
    p = 12 / 16
    torch.testing.assert_close(entropy, torch.tensor([[0.0, -(p * math.log2(p) + (1 - p) * math.log2(1 - p))]]))
    torch.testing.assert_close(patch_entropy(rgb2, 4), torch.tensor([[2.0]]))  # four equal levels
    pixels = denormalize(torch.zeros(1, 3, 2, 2), [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    assert float(pixels.min()) == float(pixels.max()) == 127.5


def test_cell_ids_grid_and_extra():
    ids = cell_ids([VisualSegment(0, 1, 4, 4)], 16, 2.0).view(4, 4)
    assert ids.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    with_cls = cell_ids([VisualSegment(0, 1, 2, 2, extra=1), VisualSegment(5, 1, 2, 2, extra=1)], 10, 1.0)
    assert with_cls.tolist() == [-1, 0, 1, 2, 3, -1, 4, 5, 6, 7]


def test_recycled_tokens_are_weighted_cell_means_and_count_is_right():
    torch.manual_seed(0)
    side, n, a = 6, 36, 3.0
    hidden = torch.randn(1, n, 5)
    importance = torch.rand(1, n)
    alive = torch.ones(1, n, dtype=torch.bool)
    keep_count = 12
    keep = torch.zeros(1, n, dtype=torch.bool)
    keep[0, importance[0].topk(keep_count).indices] = True
    n_merge = torch.tensor([math.floor(n / a**2)])  # 4
    demoted = lowest_kept(importance, keep, n_merge)
    assert int(demoted.sum()) == 4 and bool(importance[demoted].max() <= importance[keep & ~demoted].min())
    candidate = alive & (~keep | demoted)
    cells = cell_ids([VisualSegment(0, 1, side, side)], n, a)[None]
    representative, merged = recycle(hidden, importance, candidate, cells)
    final = (keep & ~demoted) | representative
    occupied = cells[candidate].unique()
    assert int(final.sum()) == n - (n - keep_count) - 4 + occupied.numel()
    for cell in occupied.tolist():
        members = candidate[0] & (cells[0] == cell)
        weights = importance[0, members]
        expected = (weights[:, None] * hidden[0, members]).sum(0) / weights.sum()
        slot = int(torch.nonzero(members)[importance[0, members].argmax()])
        assert bool(representative[0, slot])
        torch.testing.assert_close(merged[0, slot], expected)
    untouched = ~representative[0]
    torch.testing.assert_close(merged[0, untouched], hidden[0, untouched])


def test_recycle_clamps_negative_importance_and_uses_plain_mean_for_zero_weight_cells():
    hidden = torch.tensor([[[1.0], [3.0], [5.0], [7.0]]])
    importance = torch.tensor([[-1.0, -2.0, 0.5, 1.5]])
    candidate = torch.ones(1, 4, dtype=torch.bool)
    cells = torch.tensor([[0, 0, 1, 1]])
    representative, merged = recycle(hidden, importance, candidate, cells)
    assert representative.tolist() == [[True, False, False, True]]
    torch.testing.assert_close(merged[0, :, 0], torch.tensor([2.0, 3.0, 5.0, (0.5 * 5 + 1.5 * 7) / 2.0]))


# -- budgets -----------------------------------------------------------------------------------------------
def test_average_retention_and_vflowopt_r3():
    stages = (Stage(0, 0.5), Stage(1, 0.25), Stage(3, 0.125))
    assert B.average_retention(stages, 4) == pytest.approx((0.5 + 2 * 0.25 + 0.125) / 4)
    assert B.average_retention((Stage(2, 0.5),), 4) == pytest.approx(0.75)
    r3 = B.solve_r3(0.25, 0.2651, 0.9833, (9, 9, 10))
    released = (0.2651 * 9 + 0.2651 * 0.9833 * 9 + 0.2651 * 0.9833 * r3 * 10) / 28
    assert released == pytest.approx(0.25) and r3 == pytest.approx(0.8773, abs=1e-2)
    released_r3 = (0.2651 * 9 + 0.2651 * 0.9833 * 9 + 0.2651 * 0.9833 * 0.8773 * 10) / 28
    assert released_r3 == pytest.approx(0.251, abs=1e-3)  # the spec's check column
    keep = B.solve_keep(lambda k: (Stage(1, k),), 0.5, 4)
    assert keep == pytest.approx(1 / 3, abs=1e-9)
    assert B.solve_keep(lambda k: (Stage(3, k),), 0.5, 4) is None
    with pytest.raises(B.InfeasibleBudget, match="raise --budget"):
        B.feasible_single_layers(0.2, 4)


def test_ttv_equals_direct_recomputation_from_captured_hidden_states():
    from vtprune.adapters import get_adapter

    import vtprune
    from vtprune.models.tiny import random_image, tiny_inputs

    model, processor = _tiny("llava")
    adapter = get_adapter(model)
    inputs = tiny_inputs(processor, "llava", [("what color is the circle?", [random_image(120, 90, 3)])])
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index in (0, 1, 2):
        layer = adapter.decoder_layers[index]
        hooks.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=index: captured.__setitem__((i, "x"), (args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, args, out, i=index: captured.__setitem__((i, "attn"), out[0].detach())))
    try:
        from dataclasses import dataclass, field

        from vtprune.methods.transprune import TokenTransitionVariation

        @dataclass(frozen=True)
        class Spy(TokenTransitionVariation):  # the call's state is dropped after the prefill: read it here
            seen: dict = field(default_factory=dict)

            def score(self, ctx):
                out = self.accumulated_ttv(ctx)
                self.seen["ttv"] = ctx.state["ttv"].clone()
                return out

        spy = Spy(ttv_start=0)
        with torch.no_grad(), vtprune.apply(model, spy, schedule="2:0.5"):
            model(**inputs)
            state = spy.seen["ttv"]
    finally:
        for hook in hooks:
            hook.remove()
    visual = adapter.visual_mask(inputs["input_ids"])[0]
    expected = torch.zeros(int(visual.sum()))
    for index in (0, 1):
        layer = adapter.decoder_layers[index]
        x, attn_out, out = captured[(index, "x")][0], captured[(index, "attn")][0], captured[(index + 1, "x")][0]
        h = x + attn_out
        pairs = [(layer.input_layernorm(x), attn_out), (layer.post_attention_layernorm(h), out - h)]
        for t_in, t_out in pairs:
            cos = torch.stack([torch.dot(a, b) / (a.norm() * b.norm()) for a, b in zip(t_in, t_out, strict=True)])
            ratio = torch.stack([b.norm() / a.norm() for a, b in zip(t_in, t_out, strict=True)])
            weights = torch.exp(1 - cos) / torch.exp(1 - cos).sum()
            expected += (weights * ratio)[visual]
    torch.testing.assert_close(state[0, : expected.numel()], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("model_type", "aspect"), [("llava_next", None), ("llava_onevision", "anyres_max_9"),
                                                    ("llava_onevision", "anyres_max_1")])
def test_tile_layouts_match_the_model_packing(model_type, aspect):

    from vtprune.methods.tiles import layout_from_size, layouts_from_features, tile_values
    from vtprune.models.tiny import random_image, tiny_inputs

    model, processor = _tiny(model_type)
    previous = getattr(model.config, "vision_aspect_ratio", None)
    if aspect is not None:
        model.config.vision_aspect_ratio = aspect  # anyres_max_1 forces OneVision's bilinear downsizing
    try:
        sizes = [(120, 90), (64, 80), (200, 90), (90, 250), (112, 112)]
        inputs = tiny_inputs(processor, model_type, [("q?", [random_image(w, h, i)]) for i, (w, h) in enumerate(sizes)])
        kwargs = {k: inputs[k] for k in ("pixel_values", "image_sizes")}
        with torch.no_grad():
            encoded = model.model.get_image_features(**kwargs, return_dict=True)
        from_sizes = [layout_from_size(model.config, s) for s in inputs["image_sizes"]]
        crops = sum(layout.crops for layout in from_sizes)
        recovered = layouts_from_features(model.config, list(encoded.pooler_output), model.model.image_newline, crops)
        assert [x.final for x in recovered] == [x.final for x in from_sizes]
        assert [(x.rows, x.cols) for x in recovered] == [(x.rows, x.cols) for x in from_sizes]
        if aspect == "anyres_max_1":
            assert any(x.final != x.unpadded for x in from_sizes)
        side = 8
        values = torch.rand(crops, side * side)
        counts = [x.crops for x in from_sizes]
        ours = torch.cat([tile_values(p, x, side) for p, x in zip(values.split(counts), from_sizes, strict=True)])
        features = [p[..., None] for p in values.split(counts)]
        newline = torch.ones(1)
        if model_type == "llava_onevision":
            packed, _ = model.model.pack_image_features(features, inputs["image_sizes"], image_newline=newline,
                                                        vision_aspect_ratio=model.config.vision_aspect_ratio)
        else:
            packed, _ = model.model.pack_image_features(features, inputs["image_sizes"], "default", image_newline=newline)
        packed = torch.cat([p.reshape(-1) for p in packed]) if isinstance(packed, (list, tuple)) else packed.reshape(-1)
        torch.testing.assert_close(ours, packed)
    finally:
        if aspect is not None:
            model.config.vision_aspect_ratio = previous


def test_vit_attention_equals_the_towers_eager_weights():
    from vtprune.methods.vit import vit_attention
    from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

    model, processor = tiny_model("llava", "eager", image_size=112)
    pixels = tiny_inputs(processor, "llava", [("q?", [random_image(120, 90, 0)]), ("q?", [random_image(60, 90, 1)])])
    tower = model.model.vision_tower
    with torch.no_grad():
        out = tower(pixels["pixel_values"], output_hidden_states=True, output_attentions=True)
        for index, layer in enumerate(tower.vision_model.encoder.layers if hasattr(tower, "vision_model")
                                      else tower.encoder.layers):
            ours = vit_attention(layer, out.hidden_states[index], chunk=1)
            torch.testing.assert_close(ours, out.attentions[index].mean(dim=1).float(), atol=1e-6, rtol=1e-5)
