"""The contract matrix: every method x every family x {sdpa, eager} on tiny models.

For each cell: ``keep=1`` equals the unwrapped model (batch 1 and a ragged, left-padded batch of 2); a batch
equals its samples alone (prefill and decode, kept indices included); cached decoding equals the independent
reference of ``independent_reference.py`` (no cache, plain indexing, no engine code).
"""

from __future__ import annotations

import functools

import pytest
import torch
from independent_reference import reference_decode, reference_decode_kv

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, TINY_TYPES, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
STEPS = 4
MULTI_STAGE = ("pdrop", "ttv", "transprune")
PRE_LLM = ("visionzip", "divprune", "temporal")  # default stage at layer 0 (Qwen3-VL: DeepStack rows dropped too)
CASES = [*vtprune.list_methods(), "random@0", "pdrop@compact", "temporal@fastv", "pdrop@release", "fastv+debias@release"]


@functools.cache
def _model(model_type: str, impl: str):
    return tiny_model(model_type, impl, image_size=112)


def _samples(model_type: str, method: str = "") -> list:
    if method == "temporal":  # a video method: frames as images, a ragged batch of 2 and 3 frames
        return [("what color is the circle?", [random_image(120, 90, 1), random_image(120, 90, 4)]),
                ("how many?", [random_image(64, 64, 2), random_image(64, 64, 5), random_image(64, 64, 6)])]
    if model_type.startswith("qwen"):
        return [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    return [("what color is the circle?", [random_image(120, 90, 1)]),
            ("how many squares are there?", [random_image(64, 80, 2), random_image(90, 60, 3)])]


def _options(case: str, model_type: str) -> tuple[str, dict]:
    """``(method, wrap options)`` of a matrix case on ``model_type`` (Qwen3-VL prunes from layer 2 on)."""
    method, _, variant = case.partition("@")
    options: dict = {}
    if variant == "0":
        options["layer"] = 0
    if variant == "compact":
        options["positions"] = "compact"
    if variant == "release":
        options["parity"] = "release"
    if model_type == "qwen3_vl" and method in (*MULTI_STAGE, "vflowopt"):
        options["schedule"] = "2:0.6,3:0.4"
    if method in ("vflowopt", "sparsevlm", "vscan"):
        options["recycle"] = False  # the reference gathers tokens; recycling merges them (tested elsewhere)
    if method == "visionzip":
        options["contextual"] = 0.0  # the reference gathers tokens; the contextual merge is tested elsewhere
    if variant == "fastv":  # temporal pre-LLM, then FastV per frame at layer 2
        options["then"] = "fastv"
        options.pop("layer", None)
        if model_type == "qwen3_vl":
            options["schedule"] = "2:0.6,3:0.4"
    return method, options


def _supported(case: str, model_type: str) -> bool:
    method, options = _options(case, model_type)
    if options.get("positions") == "compact" and model_type.startswith("qwen"):
        return False
    if options.get("parity") == "release" and model_type.startswith("qwen") and method == "pdrop":
        return False  # the release compacts 1-D positions; refused on M-RoPE
    return True


def _evidence(handle, inputs, model_type: str) -> None:
    counts = handle.adapter.visual_mask(inputs["input_ids"]).sum(dim=1).tolist()
    generator = torch.Generator().manual_seed(7)
    handle.set_evidence([torch.rand(int(n), generator=generator) for n in counts])


def _generate(model, inputs):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("case", CASES)
def test_contract(case, model_type, impl):
    if not _supported(case, model_type):
        method, options = _options(case, model_type)
        with pytest.raises(ValueError, match="needs clip_tower|compact|cannot prune before"):
            vtprune.wrap(_model(model_type, impl)[0], method, keep=0.5, **options)
        return
    model, processor = _model(model_type, impl)
    method, options = _options(case, model_type)
    samples = _samples(model_type, method)
    batch = tiny_inputs(processor, model_type, samples)
    alone = [tiny_inputs(processor, model_type, [s]) for s in samples]
    _check_identity(model, method, options, batch, alone[0], model_type)
    if method == "none":
        return
    with vtprune.apply(model, method, keep=0.4, **options) as handle:
        if method == "oracle":
            _evidence(handle, batch, model_type)
        tokens, logits = _generate(model, batch)
        stats = handle.last_stats
        stages = [s.layer for s in handle.stages]
        for row, inputs in enumerate(alone):
            if method == "oracle":
                handle.set_evidence([_row_evidence(handle, batch, model_type, row)])
            alone_tokens, alone_logits = _generate(model, inputs)
            assert handle.last_stats.kept_indices == [stage[row:row + 1] for stage in stats.kept_indices]
            assert torch.equal(alone_tokens[0], tokens[row])
            torch.testing.assert_close(alone_logits[0], logits[row], atol=1e-4, rtol=0)
    for row in range(len(samples)):
        kept = [stage[row] for stage in stats.kept_indices]
        if method == "prefixkv":  # KV retention: each layer attends to its own kept entries
            ref_tokens, ref_logits = reference_decode_kv(model, alone[row], kept, STEPS, suppress=len(SPECIAL_TOKENS))
        else:
            ref_tokens, ref_logits = reference_decode(model, alone[row], stages, kept, STEPS,
                                                      suppress=len(SPECIAL_TOKENS),
                                                      compact=handle.plan.positions == "compact")
        assert torch.equal(ref_tokens, tokens[row])
        torch.testing.assert_close(ref_logits, logits[row], atol=1e-4, rtol=0)


def _row_evidence(handle, batch, model_type: str, row: int) -> torch.Tensor:
    counts = handle.adapter.visual_mask(batch["input_ids"]).sum(dim=1).tolist()
    generator = torch.Generator().manual_seed(7)
    return [torch.rand(int(n), generator=generator) for n in counts][row]


def _check_identity(model, method: str, options: dict, batch: dict, one: dict, model_type: str) -> None:
    """``keep=1`` through every hook equals the unwrapped model, alone and in a padded batch."""
    if "schedule" in options:
        options = {**options, "schedule": ",".join(f"{part.split(':')[0]}:1" for part in options["schedule"].split(","))}
    with torch.no_grad():
        references = [model(**inputs).logits for inputs in (one, batch)]
        with vtprune.apply(model, method, keep=1.0, **options) as handle:
            for inputs, reference in zip((one, batch), references, strict=True):
                if method == "oracle":
                    _evidence(handle, inputs, model_type)
                logits = model(**inputs).logits
                valid = inputs["attention_mask"].bool()
                torch.testing.assert_close(logits[valid], reference[valid], atol=1e-5, rtol=0)
