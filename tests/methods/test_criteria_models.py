"""TransPrune, TTV, VFlowOpt and debiasing on the tiny models of every family they support (CPU, offline)."""

from __future__ import annotations

import functools

import pytest
import torch

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, TINY_TYPES, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
LLAVA_FAMILY = ("llava", "llava_next", "llava_onevision")


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


def _inputs(model_type: str, samples=None):
    _, processor = _model(model_type)
    samples = samples or [("what color is the circle?", [random_image(120, 90, 0)])]
    return tiny_inputs(processor, model_type, samples)


def _schedule(model_type: str, keeps=(0.6, 0.3)) -> dict:
    """Qwen3-VL prunes from layer 2 on (DeepStack); the others use the method's default schedule."""
    return {"schedule": f"2:{keeps[0]},3:{keeps[1]}"} if model_type == "qwen3_vl" else {}


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


@pytest.mark.parametrize("method", ["transprune", "ttv"])
@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_transprune_runs_and_keep_one_equals_unwrapped(model_type, method):
    model, _ = _model(model_type)
    inputs = _inputs(model_type)
    with torch.no_grad():
        reference = model(**inputs).logits
        with vtprune.apply(model, method, keep=1.0, **_schedule(model_type, (1.0, 1.0))):
            same = model(**inputs).logits
        with vtprune.apply(model, method, keep=0.25, **_schedule(model_type)) as handle:
            pruned = model(**inputs).logits
            tokens, _ = _generate(model, inputs)
    torch.testing.assert_close(same, reference, atol=1e-5, rtol=0)
    assert pruned.shape[-1] == reference.shape[-1] and tokens.shape == (1, 3)
    stats = handle.last_stats
    assert stats.kept[-1] == [vtprune.keep_count(handle.stages[-1].keep, stats.visual_tokens[0])]


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_transprune_batch_equals_samples_alone(model_type):
    model, _ = _model(model_type)
    samples = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 80, 2)])]
    with vtprune.apply(model, "transprune", keep=0.3, **_schedule(model_type)) as handle:
        batch_tokens, batch_logits = _generate(model, _inputs(model_type, samples))
        batch_stats = handle.last_stats
        for row, sample in enumerate(samples):
            tokens, logits = _generate(model, _inputs(model_type, [sample]))
            torch.testing.assert_close(batch_logits[row], logits[0], atol=1e-4, rtol=0)
            assert torch.equal(batch_tokens[row], tokens[0])
            for stage in range(len(handle.stages)):
                assert batch_stats.kept_indices[stage][row] == handle.last_stats.kept_indices[stage][0]


@pytest.mark.parametrize("model_type", ["llava", "llava_next", "qwen2_vl", "qwen3_vl"])
def test_transprune_cached_decoding_equals_oracle_recomputation(model_type):
    model, _ = _model(model_type)
    inputs = _inputs(model_type)
    with vtprune.apply(model, "transprune", keep=0.3, debias=True, **_schedule(model_type)) as handle:
        generated, logits = _generate(model, inputs, steps=4)
        stats, stages = handle.last_stats, handle.stages
    weights = torch.zeros(stats.visual_tokens[0])
    for kept in stats.kept_indices:
        weights[torch.tensor(kept[0])] += 1.0  # nested sets: the oracle keeps exactly the same per stage
    schedule = ",".join(f"{s.layer}:{s.keep}" for s in stages)
    with torch.no_grad(), vtprune.apply(model, "oracle", schedule=schedule) as oracle:
        oracle.set_evidence([weights])
        recomputed = model(**_extended(inputs, generated), use_cache=False).logits[:, -generated.shape[1]:]
    torch.testing.assert_close(recomputed, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", LLAVA_FAMILY)
def test_vflowopt_runs_keep_one_batch_and_cached_decoding(model_type):
    model, _ = _model(model_type)
    samples = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 80, 2)])]
    batch = _inputs(model_type, samples)
    options = dict(keep=0.3, alpha=0.5, cell=3.0)
    with torch.no_grad():
        reference = model(**batch).logits
        with vtprune.apply(model, "vflowopt", keep=1.0):
            same = model(**batch).logits
    valid = batch["attention_mask"].bool()  # padding positions carry no meaning
    torch.testing.assert_close(same[valid], reference[valid], atol=1e-5, rtol=0)
    with vtprune.apply(model, "vflowopt", **options) as handle:
        batch_tokens, batch_logits = _generate(model, batch, steps=4)
        batch_stats = handle.last_stats
        assert [s.layer for s in handle.stages][0] == 0
        for row, sample in enumerate(samples):
            alone = _inputs(model_type, [sample])
            tokens, logits = _generate(model, alone, steps=4)
            torch.testing.assert_close(batch_logits[row], logits[0], atol=1e-4, rtol=0)
            assert torch.equal(batch_tokens[row], tokens[0])
            assert [k[row] for k in batch_stats.kept_indices] == [k[0] for k in handle.last_stats.kept_indices]
            # Cached decoding equals a no-cache forward of prompt + generated tokens (same map, same recycling).
            with torch.no_grad():
                recomputed = model(**_extended(alone, tokens), use_cache=False).logits[:, -tokens.shape[1]:]
            torch.testing.assert_close(recomputed, logits, atol=1e-4, rtol=0)


def test_vflowopt_recycles_and_rejects_unsupported_towers():
    model, _ = _model("llava")
    inputs = _inputs("llava")
    with torch.no_grad(), vtprune.apply(model, "vflowopt", keep=0.25, cell=4.0, r1=0.25, r2=1.0) as handle:
        model(**inputs)
    kept = handle.last_stats.kept[0][0]
    base, n_merge = vtprune.keep_count(0.25, 64), 64 // 16
    assert base - n_merge < kept <= base - n_merge + 4  # 2 x 2 cells of side 4 on the 8 x 8 grid
    with torch.no_grad(), vtprune.apply(model, "vflowopt", keep=0.25, cell=4.0, r1=0.25, r2=1.0, recycle=False) as h:
        model(**inputs)
    assert h.last_stats.kept[0][0] == base
    qwen, _ = _model("qwen2_5_vl")  # Qwen-VL towers: test_vflowopt_qwen.py; a windowed block is refused
    pristine = [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in qwen.named_modules()]
    with pytest.raises(ValueError, match="vit_layer=0 is not a full-attention block"):
        vtprune.wrap(qwen, "vflowopt", keep=0.25, vit_layer=0)
    assert [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in qwen.named_modules()] == pristine
    assert not hasattr(qwen, "_vtprune_handle")


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_debiased_hosts_run_on_every_family(model_type):
    model, _ = _model(model_type)
    inputs = _inputs(model_type)
    layer = {"layer": 2}
    with torch.no_grad():
        for method, options in (("fastv+debias", layer), ("pdrop", {"debias": True, **_schedule(model_type)})):
            with vtprune.apply(model, method, keep=0.25, **options) as handle:
                model(**inputs)
            final = handle.stages[-1].keep
            assert handle.last_stats.kept[-1] == [vtprune.keep_count(final, handle.last_stats.visual_tokens[0])]


def test_debias_padding_mask_drops_padded_rows():
    from vtprune.methods.debias import set_image_sizes

    model, _ = _model("llava")
    inputs = _inputs("llava", [("what color is the circle?", [random_image(120, 90, 4)])])
    padded_rows = set(range(8)) | set(range(56, 64))
    with torch.no_grad(), vtprune.apply(model, "fastv+debias", keep=0.5, layer=2) as handle:
        model(**inputs)
        assert padded_rows & set(handle.last_stats.kept_indices[0][0])  # no sizes given: nothing is masked
        set_image_sizes(handle, [(90, 120)])
        model(**inputs)
        assert not padded_rows & set(handle.last_stats.kept_indices[0][0])
