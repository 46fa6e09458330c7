"""Big-model dispatch: accelerate's offload hooks (weights on ``meta`` until each module runs) and torch.compile."""

from __future__ import annotations

import pytest
import torch
from accelerate import cpu_offload, dispatch_model

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)


def _inputs(processor, model_type: str) -> dict:
    if model_type.startswith("qwen"):
        samples = [("what color?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    else:
        samples = [("what color?", [random_image(120, 90, 1)]),
                   ("how many?", [random_image(64, 80, 2), random_image(90, 60, 3)])]
    return tiny_inputs(processor, model_type, samples)


def _generate(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), return_dict_in_generate=True)
    return torch.stack(out.logits, dim=1)


def _disk_offload(model, folder) -> torch.nn.Module:
    """Layers 1-2 and the LM head offloaded to disk, the rest on the CPU (all weights of those on ``meta``)."""
    lm = "model.language_model"
    device_map = {"model.visual" if hasattr(model.model, "visual") else "model.vision_tower": "cpu",
                  f"{lm}.embed_tokens": "cpu", f"{lm}.layers.0": "cpu", f"{lm}.layers.1": "disk",
                  f"{lm}.layers.2": "disk", f"{lm}.layers.3": "cpu", f"{lm}.norm": "cpu", f"{lm}.rotary_emb": "cpu",
                  "lm_head": "disk"}
    if hasattr(model.model, "multi_modal_projector"):
        device_map["model.multi_modal_projector"] = "cpu"
    return dispatch_model(model, device_map=device_map, offload_dir=str(folder))


@pytest.mark.parametrize(("model_type", "offload", "cases"), [
    ("llava", "cpu", [("fastv", {}), ("transprune", {}), ("vflowopt", {}), ("random", {"layer": 0})]),
    ("qwen2_5_vl", "disk", [("pdrop", {}), ("transprune", {}), ("random", {"layer": 0})]),
])
def test_offloaded_model_prunes_like_the_plain_one(model_type, offload, cases, tmp_path):
    reference, processor = tiny_model(model_type, image_size=112)
    dispatched, _ = tiny_model(model_type, image_size=112)
    if offload == "cpu":
        cpu_offload(dispatched, execution_device="cpu")
    else:
        dispatched = _disk_offload(dispatched, tmp_path)
    assert any(p.device.type == "meta" for p in dispatched.parameters())
    inputs = _inputs(processor, model_type)
    for method, options in cases:
        with vtprune.apply(reference, method, keep=0.4, **options) as handle:
            expected, kept = _generate(reference, inputs), handle.last_stats.kept_indices
        with vtprune.apply(dispatched, method, keep=0.4, **options) as handle:
            got = _generate(dispatched, inputs)
            assert handle.last_stats.kept_indices == kept
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compiled_model_cannot_be_wrapped_but_a_wrapped_model_compiles():
    model, processor = tiny_model("llava", image_size=112)
    inputs = _inputs(processor, "llava")
    with torch.no_grad():
        plain = model(**inputs).logits
        with vtprune.apply(model, "fastv", keep=0.25):
            pruned = model(**inputs).logits
        for compiled in (torch.compile(model, backend="eager"),):
            with pytest.raises(ValueError, match="Wrap the plain model first"):
                vtprune.wrap(compiled, "fastv", keep=0.25)
        model.forward = torch.compile(model.forward, backend="eager")
        with pytest.raises(ValueError, match="Wrap the plain model first"):
            vtprune.wrap(model, "fastv", keep=0.25)
        del model.forward
        handle = vtprune.wrap(model, "fastv", keep=0.25)
        compiled = torch.compile(model, backend="eager")  # the hooks run eagerly between graph breaks
        # Pruned visual positions are NaN in the input layout (vtprune.outputs), at the same positions.
        torch.testing.assert_close(compiled(**inputs).logits, pruned, atol=1e-5, rtol=0, equal_nan=True)
        handle.remove()
        torch.testing.assert_close(compiled(**inputs).logits, plain, atol=1e-5, rtol=0)
