"""Load a model and its processor: the embedded default, a tiny random model, or any checkpoint.

``spec`` forms accepted everywhere a ``--model`` is taken:

* ``None`` / ``"embedded"`` / ``"embedded:llava"`` / ``"embedded:qwen2_vl"``: models shipped in the package;
* ``"tiny:<model_type>"``: a random tiny model built from config (tests, smoke runs);
* a local folder or a hub id (``llava-hf/llava-1.5-7b-hf``, ``Qwen/Qwen2.5-VL-7B-Instruct``): the real
  ``from_pretrained`` path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


def resolve_model(spec: str | None) -> str:
    """The folder / hub id / ``tiny:`` spec that ``spec`` names (the embedded LLaVA by default)."""
    from vtprune.embedded import embedded_model_path

    if spec in (None, "", "embedded"):
        return str(embedded_model_path("llava"))
    if spec.startswith("embedded:"):
        return str(embedded_model_path(spec.split(":", 1)[1]))
    return spec


def load(spec: str | None = None, attn_implementation: str = "sdpa", dtype: str = "float32",
         device: str | None = None) -> tuple[Any, Any]:
    """``(model, processor)`` for ``spec``, in eval mode on ``device`` (CUDA when available by default)."""
    from vtprune.testing import tiny_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = resolve_model(spec)
    if target.startswith("tiny:"):
        model, processor = tiny_model(target.split(":", 1)[1], attn_implementation)
        return model.to(device), processor
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        target, attn_implementation=attn_implementation, dtype=DTYPES[dtype], device_map=device
    ).eval()
    return model, load_processor(target)


def load_processor(path: str) -> Any:
    """``AutoProcessor.from_pretrained(path)``; Qwen-VL processors without torchvision are rebuilt from parts."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path)
    except (AttributeError, ImportError, OSError, ValueError, TypeError) as error:
        model_type = AutoConfig.from_pretrained(path).model_type
        if not model_type.startswith("qwen"):
            raise
        processor = _qwen_processor(model_type, AutoImageProcessor.from_pretrained(path),
                                    AutoTokenizer.from_pretrained(path), error)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        tokenizer.padding_side = "left"
    return processor


def _qwen_processor(model_type: str, image_processor: Any, tokenizer: Any, error: Exception) -> Any:
    import transformers

    from vtprune.testing import no_video_processor

    names = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    if model_type not in names:
        raise error
    cls = no_video_processor(getattr(transformers, names[model_type]))
    template = getattr(tokenizer, "chat_template", None)
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template)


def model_label(spec: str | None) -> str:
    """A short human name for reports (``embedded:llava``, a folder name, or the hub id)."""
    if spec in (None, "", "embedded"):
        return "embedded:llava"
    if spec.startswith(("embedded:", "tiny:")):
        return spec
    return Path(spec).name if Path(spec).exists() else spec
