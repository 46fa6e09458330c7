"""PrefixKV (arXiv:2412.03409): the budget math by hand, and KV retention in the engine against an independent
reference (each layer attends only to its kept entries), batches, KV bytes, profiles and bad input."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import pytest
import torch
from cases import two_samples
from independent_reference import reference_decode_kv

import vtprune
from vtprune.errors import UserError
from vtprune.methods import Debiased, PerFrame, Wrapper
from vtprune.methods.prefixkv import (
    PROFILE_FORMAT,
    PrefixKV,
    counts_at,
    counts_from_ratios,
    layer_budgets,
    profile_ratios,
    read_profile,
    retention_curves,
)
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)


def _cache(output):
    """The cache of a generate() output (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    return getattr(output, "cache", None) or output.past_key_values
STEPS = 4


# -- math by hand --------------------------------------------------------------------------------------------
def test_retention_curves_and_counts_by_hand():
    priority = torch.tensor([[1.0, 3.0, 0.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    curves = retention_curves(priority)
    torch.testing.assert_close(curves, torch.tensor([[0.5, 0.875, 1.0, 1.0], [0.25, 0.5, 0.75, 1.0]],
                                                    dtype=torch.float64))
    # keep_l = #{n: P_l(n) < p} + 1: at p = 0.6 the peaked layer keeps 2, the flat one 3.
    assert counts_at(curves, 0.6).tolist() == [2, 3]


def test_layer_budgets_hit_the_average_exactly_and_favour_peaked_layers():
    priority = torch.tensor([[8.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    counts = layer_budgets(priority, keep=0.5)  # 0.5 of 2 x 4 = 4 tokens in all
    assert sum(counts) == 4 and counts[0] < counts[1]
    assert layer_budgets(priority, keep=1.0) == [4, 4]
    assert layer_budgets(priority, keep=0.01) == [1, 1]  # at least one token per layer
    assert layer_budgets(torch.zeros(3, 0), keep=0.5) == [0, 0, 0]


def test_profile_ratios_and_counts():
    assert counts_from_ratios([0.0, 0.5, 0.76], 10) == [10, 5, 2]
    budgets = {0.2: [0.9, 0.7], 0.6: [0.5, 0.3]}
    assert profile_ratios(budgets, 0.4) == pytest.approx([0.7, 0.5])
    with pytest.raises(UserError, match="outside the budgets"):
        profile_ratios(budgets, 0.9)


def _profile(tmp_path, **override):
    data = {"format": PROFILE_FORMAT, "model_type": "llava", "num_layers": 4, "scope": "prompt",
            "budgets": {"0.3": [0.8, 0.7, 0.6, 0.7], "0.7": [0.4, 0.3, 0.2, 0.3]}}
    data.update(override)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_profiles_are_checked_against_the_model(tmp_path):
    assert read_profile(_profile(tmp_path), "llava", 4, "prompt")[0.3] == [0.8, 0.7, 0.6, 0.7]
    with pytest.raises(UserError, match="model_type='qwen2_vl'"):
        read_profile(_profile(tmp_path, model_type="qwen2_vl"), "llava", 4, "prompt")
    with pytest.raises(UserError, match="num_layers=4"):
        read_profile(_profile(tmp_path), "llava", 32, "prompt")
    with pytest.raises(UserError, match=r"budgets\['0.3'\] must be 4 ratios"):
        read_profile(_profile(tmp_path, budgets={"0.3": [0.5]}), "llava", 4, "prompt")


# -- the engine ------------------------------------------------------------------------------------------------
@functools.cache
def _model(model_type: str, impl: str = "sdpa"):
    return tiny_model(model_type, impl, image_size=112)


def _samples(model_type: str) -> list:
    return two_samples(model_type)


def _generate(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1), _cache(out)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_prefixkv_decodes_like_the_reference_and_a_batch_like_its_samples(model_type, impl):
    model, processor = _model(model_type, impl)
    samples = _samples(model_type)
    batch = tiny_inputs(processor, model_type, samples)
    alone = [tiny_inputs(processor, model_type, [s]) for s in samples]
    with vtprune.apply(model, "prefixkv", keep=0.4) as handle:
        tokens, logits, cache = _generate(model, batch)
        stats = handle.last_stats
        assert stats.stage_layers == [0, 1, 2, 3] and len(stats.kept) == 4
        for row, inputs in enumerate(alone):
            alone_tokens, alone_logits, _ = _generate(model, inputs)
            assert torch.equal(alone_tokens[0], tokens[row])
            torch.testing.assert_close(alone_logits[0], logits[row], atol=1e-4, rtol=0)
    for row in range(len(samples)):
        n = stats.visual_tokens[row]
        kept = [layer[row] for layer in stats.kept_indices]
        # Layer-adaptive: on average the layers keep 0.4 of the visual tokens, exactly.
        assert sum(len(k) for k in kept) == round(0.4 * 4 * n)
        ref_tokens, ref_logits = reference_decode_kv(model, alone[row], kept, STEPS, suppress=len(SPECIAL_TOKENS))
        assert torch.equal(ref_tokens, tokens[row])
        torch.testing.assert_close(ref_logits, logits[row], atol=1e-4, rtol=0)


def test_keep_one_is_the_unwrapped_model_and_kv_bytes_shrink():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    plain_tokens, plain_logits, plain_cache = _generate(model, inputs)
    with vtprune.apply(model, "prefixkv", keep=1.0):
        tokens, logits, _ = _generate(model, inputs)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=0)
    with vtprune.apply(model, "prefixkv", keep=0.25) as handle:
        _, _, cache = _generate(model, inputs)
        stats = handle.last_stats
    prompt, visual = inputs["input_ids"].shape[1], stats.visual_tokens[0]
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    # Each layer: the prompt's text, its kept visual tokens, and the STEPS - 1 tokens decoded after the prefill.
    assert lengths == [prompt - visual + kept[0] + STEPS - 1 for kept in stats.kept]
    assert sum(lengths) < sum(layer.keys.shape[2] for layer in plain_cache.layers)


def test_prompt_scope_and_release_decoding_keep_the_ratio(tmp_path):
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt") as handle:
        _generate(model, inputs)
        prompt = int(inputs["attention_mask"].sum())
        # Every prompt token but the first and the last may go: 0.5 of them stay on average over the layers.
        assert sum(len(k) for k in handle.last_stats.kept_indices) <= 4 * prompt
    path = _profile(tmp_path)
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt", decode="release", profile=path) as handle:
        _, _, cache = _generate(model, inputs)
        call = handle.calls.lookup(cache)
        ratios = handle.kv_ratios
        seen = prompt + STEPS - 1
        for ratio, region in zip(ratios, call.regions, strict=True):
            attended = int(region.valid.sum()) + STEPS - 1
            # The cache holds (1 - ratio_l) of the tokens seen: decoding evicted prompt entries to keep it there.
            assert attended == math.ceil((1 - ratio) * seen) < region.valid.shape[1] + STEPS - 1


def test_bad_prefixkv_options_fail_at_wrap_time(tmp_path):
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="scope="):
        vtprune.wrap(model, "prefixkv", keep=0.5, scope="everything")
    with pytest.raises(ValueError, match="needs scope='prompt' and profile"):
        vtprune.wrap(model, "prefixkv", keep=0.5, decode="release")
    with pytest.raises(UserError, match="num_layers=32"):
        vtprune.wrap(model, "prefixkv", keep=0.5, scope="prompt", profile=_profile(tmp_path, num_layers=32))
    with pytest.raises(UserError, match="outside the budgets"):
        vtprune.wrap(model, "prefixkv", keep=0.9, scope="prompt", profile=_profile(tmp_path))
    assert not hasattr(model, "_vtprune_handle")


@pytest.mark.parametrize("build", [
    lambda model: vtprune.wrap(model, "prefixkv+debias", keep=0.5),
    lambda model: vtprune.wrap(model, "prefixkv", keep=0.5, debias=True),
    lambda model: vtprune.wrap(model, PrefixKV(), keep=0.5, debias=True),
    lambda model: vtprune.wrap(model, Debiased(inner=PrefixKV()), keep=0.5),
    lambda model: vtprune.wrap(model, "per_frame+debias", keep=0.5, base="prefixkv"),
], ids=["name+debias", "debias=True", "instance-debias=True", "Debiased(PrefixKV())", "per_frame+debias"])
def test_debiasing_prefixkv_is_refused_at_wrap_time(build):
    """Debiasing divides out the recency trend of the last token's attention; PrefixKV's priority is the attention a
    key receives from every prompt row. Wrapped, it used to evict nothing while the stats recorded a pruned call."""
    model, _ = _model("llava")
    with pytest.raises(ValueError, match="debias does not apply to method 'prefixkv'") as error:
        build(model)
    assert "\n" not in str(error.value) and "fastv, pdrop, sparsevlm, transprune" in str(error.value)
    assert not hasattr(model, "_vtprune_handle")


@pytest.mark.parametrize(("build", "match"), [
    (lambda model: vtprune.wrap(model, "per_frame", keep=0.5, base="prefixkv"), "per-frame budgets"),
    (lambda model: vtprune.wrap(model, PerFrame(inner=PrefixKV()), keep=0.5), "per-frame budgets"),
    (lambda model: vtprune.wrap(model, "temporal", keep=0.5, then="prefixkv"), "cannot follow temporal"),
], ids=["per_frame-base", "PerFrame(PrefixKV())", "temporal-then"])
def test_wrappers_that_cannot_serve_kv_retention_refuse_prefixkv(build, match):
    model, _ = _model("llava")
    with pytest.raises(ValueError, match=match):
        build(model)
    assert not hasattr(model, "_vtprune_handle")


@dataclass(frozen=True)
class Relabelled(Wrapper):
    """A wrapper that changes nothing: a KV-retention scorer inside it must still retain KV."""


def test_a_wrapper_around_prefixkv_retains_kv_exactly_as_prefixkv():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    with vtprune.apply(model, "prefixkv", keep=0.4) as handle:
        tokens, logits, _ = _generate(model, inputs)
        kept = handle.last_stats.kept_indices
    with vtprune.apply(model, Relabelled(inner=PrefixKV()), keep=0.4) as handle:
        assert handle.retains_kv
        wrapped_tokens, wrapped_logits, _ = _generate(model, inputs)
        assert handle.last_stats.retained_kv and handle.last_stats.kept_indices == kept
    assert torch.equal(wrapped_tokens, tokens)
    torch.testing.assert_close(wrapped_logits, logits, atol=0, rtol=0)


def test_calibrate_writes_a_profile_that_wrap_uses(tmp_path):
    from vtprune.cli import main

    out = tmp_path / "prefixkv.json"
    assert main(["calibrate", "--model", "tiny:llava", "--method", "prefixkv", "--n", "4", "--scope", "prompt",
                 "--out", str(out), "--device", "cpu"]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == PROFILE_FORMAT and data["num_layers"] == 4 and data["scope"] == "prompt"
    assert data["budgets"]["1"] == [0.0] * 4
    for budget, ratios in data["budgets"].items():  # each prompt's layers evict 1 - budget on average
        assert sum(ratios) / 4 == pytest.approx(1 - float(budget), abs=0.02)
    model, processor = tiny_model("llava")
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt", profile=str(out)) as handle:
        assert handle.kv_ratios == pytest.approx(data["budgets"]["0.5"])
