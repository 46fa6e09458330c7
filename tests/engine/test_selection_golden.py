"""The selection of every method stays bit-identical across refactors: kept indices of every stage, every
method x family (SDPA, keep 0.4, a ragged batch of 2, debias variants included), against a committed file.

Regenerate (only when a selection change is intended, and say why in the commit):
``python tests/engine/test_selection_golden.py --write``; ``--add`` writes only the cases missing from the
file (a new method), leaving every existing key as it is.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

import vtprune
from vtprune.models.tiny import TINY_TYPES, random_image, tiny_inputs, tiny_model

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "selection_golden.json"
CASES = ["fastv", "fastv+debias", "pdrop", "pdrop+debias", "ttv", "transprune", "transprune+debias", "vflowopt",
         "random", "random@0", "oracle", "per_frame", "pdrop@compact", "visionzip", "divprune", "dart", "temporal",
         "fastv+debias@release", "pdrop@release", "pdrop+debias@release", "transprune@release"]
PRE_LLM = ("visionzip", "divprune", "temporal")  # stage at layer 0; Qwen3-VL (DeepStack) prunes at layer 2


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


def _options(case: str, model_type: str) -> tuple[str, dict] | None:
    method, _, variant = case.partition("@")
    options: dict = {}
    if variant == "0":
        if model_type == "qwen3_vl":
            return None
        options["layer"] = 0
    if variant == "compact":
        if model_type.startswith("qwen"):
            return None
        options["positions"] = "compact"
    if variant == "release":  # parity="release": compacted positions are refused on M-RoPE (FastV keeps them)
        if model_type.startswith("qwen") and not method.startswith("fastv"):
            return None
        options["parity"] = "release"
    if model_type == "qwen3_vl" and method.split("+")[0] in ("pdrop", "ttv", "transprune", "vflowopt"):
        options["schedule"] = "2:0.6,3:0.4"
    if model_type == "qwen3_vl" and method in PRE_LLM:
        options["layer"] = 2
    return method, options


def selection(case: str, model_type: str) -> list | None:
    spec = _options(case, model_type)
    if spec is None:
        return None
    method, options = spec
    model, processor = _model(model_type)
    if method == "temporal":  # a video method: frames as images
        samples = [("what color is the circle?", [random_image(120, 90, 1), random_image(120, 90, 4)]),
                   ("how many?", [random_image(64, 64, 2), random_image(64, 64, 5), random_image(64, 64, 6)])]
    elif model_type.startswith("qwen"):
        samples = [("what color is the circle?", [random_image(120, 90, 1)]), ("how many?", [random_image(64, 64, 2)])]
    else:
        samples = [("what color is the circle?", [random_image(120, 90, 1)]),
                   ("how many squares are there?", [random_image(64, 80, 2), random_image(90, 60, 3)])]
    inputs = tiny_inputs(processor, model_type, samples)
    with torch.no_grad(), vtprune.apply(model, method, keep=0.4, **options) as handle:
        if method == "oracle":
            counts = handle.adapter.visual_mask(inputs["input_ids"]).sum(dim=1).tolist()
            generator = torch.Generator().manual_seed(7)
            handle.set_evidence([torch.rand(int(n), generator=generator) for n in counts])
        model(**inputs)
        return {"stages": [[s.layer, s.keep] for s in handle.stages], "kept": handle.last_stats.kept_indices}


@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("case", CASES)
def test_selection_is_unchanged(case, model_type):
    golden = json.loads(GOLDEN.read_text())
    assert selection(case, model_type) == golden[f"{case}/{model_type}"]


if __name__ == "__main__" and ("--write" in sys.argv or "--add" in sys.argv):
    torch.set_num_threads(1)
    golden = json.loads(GOLDEN.read_text()) if "--add" in sys.argv else {}
    keys = [(c, t) for c in CASES for t in TINY_TYPES if f"{c}/{t}" not in golden]
    golden.update({f"{c}/{t}": selection(c, t) for c, t in keys})
    GOLDEN.write_text(json.dumps(golden))
    print(f"wrote {len(keys)} case(s) to {GOLDEN}")
