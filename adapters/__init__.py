"""Model adapters, one file per family, chosen by ``config.model_type`` (installed as ``vtprune.adapters``)."""

from __future__ import annotations

from torch import nn
from vtprune.adapters.base import Adapter, VisualSegment
from vtprune.adapters.llava import LlavaAdapter
from vtprune.adapters.llava_next import LlavaNextAdapter
from vtprune.adapters.llava_onevision import LlavaOnevisionAdapter
from vtprune.adapters.qwen2_5_vl import Qwen25VLAdapter
from vtprune.adapters.qwen2_vl import Qwen2VLAdapter
from vtprune.adapters.qwen3_vl import Qwen3VLAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    model_type: cls
    for cls in (LlavaAdapter, LlavaNextAdapter, LlavaOnevisionAdapter, Qwen2VLAdapter, Qwen25VLAdapter, Qwen3VLAdapter)
    for model_type in cls.model_types
}


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values vtprune can wrap."""
    return sorted(ADAPTERS)


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for ``model``, chosen by ``model.config.model_type``; raises ``ValueError`` if unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"vtprune does not support model_type {model_type!r} ({type(model).__name__}); supported model types: "
            f"{', '.join(supported_model_types())}. Pass a *ForConditionalGeneration model of one of them."
        )
    adapter = ADAPTERS[model_type](model)
    if not hasattr(adapter.backbone, "language_model"):
        raise ValueError(
            f"{type(model).__name__} has no language_model submodule; wrap the *ForConditionalGeneration model "
            "(e.g. LlavaForConditionalGeneration), not a part of it."
        )
    return adapter


__all__ = ["Adapter", "VisualSegment", "ADAPTERS", "get_adapter", "supported_model_types"]
