"""``rounding="per_image"``: a sample keeps the sum of its images' (and video frames') own counts, the count the vLLM
plugin fixes per item before the tower, so several-image prompts keep exactly the plugin's rows."""

from __future__ import annotations

import pytest
import torch
from cases import lm_input_embeds
from vtprune.adapters.base import VisualSegment

import vtprune
from vtprune.config import Stage
from vtprune.methods.fastv import FastV
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model
from vtprune.plan import Plan, group_sizes
from vtprune.vllm.select import select_rows


def test_per_image_count_is_the_sum_of_each_images_count():
    """Hand-computed: keep 0.28 of two 16-token images is 4 + 4 = 8 per image (4.48 each) but 9 per sample (8.96);
    at 0.25 both give 8. A video's frames (temporal patches) count one by one, as the plugin counts them."""
    stages = (Stage(0, 0.28), Stage(2, 0.25))
    sample, per_image = Plan(FastV(), stages), Plan(FastV(), stages, rounding="per_image")
    images = [VisualSegment(0, 1, 4, 4), VisualSegment(16, 1, 4, 4)]
    groups = [group_sizes(images, 32), group_sizes([VisualSegment(0, 1, 4, 4)], 16), []]
    assert groups == [[16, 16], [16], []]
    assert sample.kept_counts([32, 16, 0]) == [[9, 4, 0], [8, 4, 0]]
    assert per_image.kept_counts([32, 16, 0], groups) == [[8, 4, 0], [8, 4, 0]]
    video = [VisualSegment(0, 3, 2, 3, kind="video")]  # 3 frames of 6: 2 + 2 + 2 (1.68, 1.5), not 5 of 18
    assert group_sizes(video, 18) == [6, 6, 6]
    assert per_image.kept_counts([18], [group_sizes(video, 18)]) == [[6], [6]]
    assert sample.kept_counts([18]) == [[5], [5]]  # 5.04, 4.5 rounded half up
    device = per_image.device_kept_counts(torch.tensor([32, 16, 0]), per_image.kept_counts([32, 16, 0], groups))
    assert device.tolist() == [[8, 4, 0], [8, 4, 0]]


def llava_inputs(images: int):
    """The tiny LLaVA (16 visual tokens per image), its inputs for one prompt of ``images`` images and the LM-input
    embeddings of each image's visual tokens (``[16, D]`` each, unwrapped model)."""
    model, processor = tiny_model("llava")
    pictures = [random_image(96, 80, 1), random_image(64, 90, 2)][:images]
    inputs = tiny_inputs(processor, "llava", [("which one is larger?", pictures)])
    embeds = lm_input_embeds(model, inputs)
    visual = inputs["input_ids"][0] == model.config.image_token_id
    return model, inputs, embeds[0, visual].chunk(images)


def kept(model, inputs, method: str, keep: float, **options) -> list[int]:
    with vtprune.apply(model, method, keep=keep, **options) as handle, torch.no_grad():
        model(**inputs)
    return handle.last_stats.kept_indices[-1][0]


@pytest.mark.parametrize("keep", [0.28, 0.25])
def test_two_images_keep_the_plugins_rows(keep):
    """divprune with ``rounding="per_image"`` keeps exactly the rows of :func:`vtprune.vllm.select.select_rows` run
    on each image's own LM-input embeddings; at 0.28 the default budget keeps one row more (9 vs 8 of 2 x 16)."""
    model, inputs, images = llava_inputs(2)
    want, start = [], 0
    for embeddings in images:
        want += (select_rows("divprune", embeddings, keep) + start).tolist()
        start += embeddings.shape[0]
    assert kept(model, inputs, "divprune", keep, rounding="per_image") == want
    default = kept(model, inputs, "divprune", keep)
    assert len(default) - len(want) == (1 if keep == 0.28 else 0)


@pytest.mark.parametrize("method", ["divprune", "fastv", "visionzip"])
def test_one_image_per_image_budget_equals_the_default(method):
    model, inputs, _ = llava_inputs(1)
    assert kept(model, inputs, method, 0.28, rounding="per_image") == kept(model, inputs, method, 0.28)


@pytest.mark.parametrize(("options", "match"), [
    ({"rounding": "image"}, r"rounding must be 'sample'.*got 'image'"),
    ({"method": "temporal", "rounding": "per_image"}, r"spends one budget over a whole video"),
    ({"method": "prefixkv", "rounding": "per_image"}, r"evicts cache entries"),
])
def test_bad_budget_refused_at_wrap_time(options, match):
    model = tiny_model("llava")[0]
    options = {"method": "divprune", **options}
    with pytest.raises(ValueError, match=match):
        vtprune.wrap(model, options.pop("method"), keep=0.25, **options)


def test_rounding_does_not_shadow_a_method_option_named_budget():
    """VFlowOpt's own ``budget=`` (its average retention) still reaches the method through ``wrap``."""
    model, _ = tiny_model("llava")
    handle = vtprune.wrap(model, "vflowopt", keep=0.25, budget=0.5)
    try:
        assert handle.plan.scorer.budget == 0.5 and handle.plan.rounding == "sample"
    finally:
        handle.remove()
