"""The installed vLLM has every private API the plugin reaches (vtprune.vllm.api_check, no engine), and its version
is one the plugin accepts."""

from __future__ import annotations


def test_installed_vllm_has_the_private_apis_the_plugin_uses():
    from vtprune.vllm import api_check

    root = api_check.installed_vllm()
    missing = [f"{label}: {problem}" for label, problem in api_check.check_tree(root)
               if problem and not problem.startswith("(as ")]
    assert missing == []


def test_installed_vllm_is_in_the_tested_set():
    import vllm

    from vtprune.vllm.settings import TESTED_VLLM, check_vllm_version, version_tuple

    assert check_vllm_version() == vllm.__version__
    assert version_tuple(vllm.__version__) in TESTED_VLLM
