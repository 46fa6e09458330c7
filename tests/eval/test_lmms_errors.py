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


@pytest.mark.parametrize("words,needle", [
    (["--video-clips", "-1"], "argument --video-clips: must be >= 0, got -1"),
    (["--n", "0"], "argument --n: must be >= 1, got 0"),
    (["--frame-stride", "0"], "argument --frame-stride: must be >= 1, got 0"),
    (["--split", "bogus"], "argument --split: invalid choice: 'bogus'"),
])
def test_lmms_prepare_names_its_options_in_one_line(tmp_path, cli, words, needle) -> None:
    """The command-line options, not prepare()'s parameters (n_images, frame_stride); nothing is written (a
    negative --video-clips used to write an empty video task)."""
    code, out, err = cli("bench", "lmms-prepare", "--out", str(tmp_path / "tasks"), *words)
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1, err
    assert "usage:" not in err and "n_images" not in err and "frame_stride" not in err
    assert not (tmp_path / "tasks").exists()
