"""Errors of the lmms-eval plugin name lmms-eval's own arguments: a bad ``pretrained=`` is not ``--model``
(in lmms-eval, ``--model`` is ``vtprune_llava`` / ``vtprune_qwen_vl``)."""

from __future__ import annotations

import pytest

from vtprune.errors import UserError


@pytest.mark.parametrize("pretrained", ["/no/such/folder", "nosuchorg/nosuchmodel"])
def test_a_bad_pretrained_value_is_named_as_pretrained(pretrained: str, monkeypatch) -> None:
    from vtprune.eval.lmms_plugin.args import parse_model_args

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as error:
        parse_model_args({"pretrained": pretrained, "method": "fastv"})
    message = str(error.value)
    assert f"pretrained={pretrained!r}" in message and "--model " not in message, message


def test_image_aspect_ratio_is_checked_before_loading() -> None:
    """``image_aspect_ratio``: ``original`` or ``pad``; ``pad`` is LLaVA-1.5's preprocessing, refused elsewhere
    before the weights are loaded."""
    from vtprune.eval.lmms_plugin.args import parse_model_args
    from vtprune.eval.lmms_plugin.models import VTPruneLlava, VTPruneQwenVL

    assert parse_model_args({}).image_aspect_ratio == "original"
    assert parse_model_args({"image_aspect_ratio": "pad"}).image_aspect_ratio == "pad"
    with pytest.raises(ValueError, match="image_aspect_ratio='square': use original"):
        parse_model_args({"image_aspect_ratio": "square"})
    with pytest.raises(ValueError, match="image_aspect_ratio=pad is LLaVA-1.5's preprocessing"):
        VTPruneQwenVL(pretrained="tiny:qwen2_vl", image_aspect_ratio="pad", device="cpu")
    with pytest.raises(ValueError, match="'llava_next' model, which prepares its images itself"):
        VTPruneLlava(pretrained="tiny:llava_next", image_aspect_ratio="pad", device="cpu")
