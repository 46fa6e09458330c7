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
