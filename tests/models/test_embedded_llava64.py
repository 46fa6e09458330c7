"""The 64-token embedded LLaVA (dense task version) loads offline from package data and answers above a floor."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from vtprune.eval.training import evaluate as E  # noqa: E402

from vtprune.models.embedded import EMBEDDED_MODELS, embedded_model_path  # noqa: E402
from vtprune.shapes import dense as D  # noqa: E402

N_IMAGES = 12  # a fixed slice of the dense test split: ~72 questions, all six types


@pytest.fixture(scope="module")
def loaded():
    path = embedded_model_path("llava64")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path).eval()
    return model, transformers.AutoProcessor.from_pretrained(path)


def test_registered_files_and_size() -> None:
    assert EMBEDDED_MODELS["llava64"] == "vtprune-llava64-shapes"
    assert EMBEDDED_MODELS["llava"] == "vtprune-llava-shapes"  # the 16-token model keeps its name
    path = embedded_model_path("llava64")
    weights = list(path.glob("*.safetensors"))
    assert weights and sum(w.stat().st_size for w in weights) < 30 * 2**20
    assert not list(path.glob("*.pt")), "training checkpoints stay out of the package"
    assert "## What it answers" in (path / "README.md").read_text()


def test_sixty_four_visual_tokens(loaded) -> None:
    model, processor = loaded
    sample = D.make_dense_split("test", 1)[0]
    enc = processor(images=[sample.image], text=[E.llava_prompt(processor, sample.questions[0].text)],
                    return_tensors="pt")
    assert int((enc["input_ids"] == model.config.image_token_id).sum()) == 64
    assert model.config.vision_config.image_size == 224 and model.config.vision_config.patch_size == 28


def test_accuracy_floor_on_a_fixed_slice(loaded) -> None:
    model, processor = loaded
    torch.manual_seed(0)
    acc = E.evaluate(model, processor, D.make_dense_split("test", N_IMAGES), batch_size=64)
    # Guard against broken weights. Chance is about 0.25 overall, 0 on 'read'; the card has the measured values.
    assert acc["overall"] >= 0.85, acc
    assert min(acc[q] for q in ("color", "shape", "exists")) >= 0.9, acc
    assert acc["read"] >= 0.6 and acc["where3"] >= 0.6, acc


def test_loads_through_vtprune_and_prunes(loaded) -> None:
    """``vtprune.load('embedded:llava64')`` works offline, and FastV at keep 0.5 still answers colour questions."""
    import vtprune

    model, processor = vtprune.load("embedded:llava64", device="cpu")
    samples = D.make_dense_split("test", N_IMAGES)
    items = [(s.image, q) for s in samples for q in s.questions if q.qtype == "color"]
    with vtprune.apply(model, method="fastv", keep=0.5):
        answers = E.answer_batch(model, processor, [im for im, _ in items], [q.text for _, q in items])
    assert sum(a == q.answer for a, (_, q) in zip(answers, items, strict=True)) >= 0.5 * len(items)


def test_commands_use_the_dense_task_for_it(capsys) -> None:
    """``vtprune run --model embedded:llava64`` asks about a dense-task image (224 px), not a 112 px one."""
    import json

    import vtprune.cli as cli
    from vtprune.models.embedded import task_of

    assert task_of("embedded:llava64") == "dense" and task_of(str(embedded_model_path("llava64"))) == "dense"
    assert task_of(None) == task_of("embedded:llava") == task_of("llava-hf/llava-1.5-7b-hf") == "shapes"
    assert cli.main(["run", "--model", "embedded:llava64", "--device", "cpu", "--keep", "0.5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["visual_tokens"] == 64 and record["answer"] == record["expected"]


def test_calibration_uses_the_dense_calib_split_and_ships() -> None:
    from vtprune.eval.tuning.calibrate import calibration_items

    assert {image.size for image, _ in calibration_items(None, 3, "dense")} == {(224, 224)}
    assert (embedded_model_path("llava64") / "calibration.json").is_file()  # +debias uses the fitted trend
