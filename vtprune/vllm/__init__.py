"""vtprune inside vLLM: visual-token pruning as a vLLM plugin (``pip install -e ".[vllm]"`` in the clone).

Pre-LLM methods prune each image's embeddings before the language model; layer-wise methods prune inside it
(:mod:`vtprune.vllm.layerwise`). vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in each
of its processes; it registers architecture names (``VtpruneLlavaForConditionalGeneration``, ...) and their config
hook (which installs what a layer-wise method needs when a model uses one). A model opts in with
``hf_overrides={"architectures": ["Vtprune..."], "vtprune": {"method": "divprune", "keep": 0.25}}``.
Importing this package imports neither vLLM nor torch; ``import vtprune`` does not import it.
"""

from __future__ import annotations

from vtprune.vllm.settings import ARCHITECTURES, VLLM_METHODS, VllmPruning, check_vllm_version

__all__ = ["ARCHITECTURES", "VLLM_METHODS", "VllmPruning", "check_vllm_version", "register"]


def register() -> None:
    """vLLM plugin entry point: register the pruned architectures (lazily, by module path); nothing else."""
    from vllm import ModelRegistry

    for name, target in ARCHITECTURES.items():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)
    from vtprune.vllm.layerwise.config import register_config_hooks

    register_config_hooks(ARCHITECTURES)
