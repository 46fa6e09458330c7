"""Locate the tiny VLMs that ship inside the vtprune package (trained on the vtprune-shapes task)."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODELS: dict[str, str] = {"llava": "vtprune-llava-shapes", "qwen2_vl": "vtprune-qwen2vl-shapes",
                                   "llava64": "vtprune-llava64-shapes"}
MODELS_DIR = Path(__file__).resolve().parent
DENSE_MODELS = frozenset({"llava64"})  # trained on the dense task version (224 px, 6-12 objects, where3)


def task_of(spec: str | None) -> str:
    """The vtprune-shapes version a model spec answers: ``"dense"`` for ``embedded:llava64`` (or its folder),
    ``"shapes"`` (112 px, 16 tokens) for everything else."""
    text = str(spec or "")
    dense = {f"embedded:{n}" for n in DENSE_MODELS} | {EMBEDDED_MODELS[n] for n in DENSE_MODELS}
    return "dense" if text in dense or Path(text).name in dense else "shapes"


def embedded_model_path(name: str = "llava") -> Path:
    """Folder of the embedded model ``name`` (a key of :data:`EMBEDDED_MODELS`), loadable with ``from_pretrained``.

    Raises ``KeyError`` for an unknown name and ``FileNotFoundError`` (naming the training command) when the
    weights are not present in the package data.
    """
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; choose one of {sorted(EMBEDDED_MODELS)}")
    path = MODELS_DIR / EMBEDDED_MODELS[name]
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        how = ("the recipe in its model card (vtprune bench train --task dense ...)" if name == "llava64"
               else f"vtprune bench train --arch {name} --minutes 80 --out {path}")
        raise FileNotFoundError(f"embedded model {name!r} not found at {path}. Train it with: {how}")
    return path


def default_video_spec() -> str:
    """``--model`` for video when none is given: the embedded Qwen2-VL (trained on clips), else the LLaVA."""
    try:
        embedded_model_path("qwen2_vl")
    except FileNotFoundError:
        return "embedded:llava"
    return "embedded:qwen2_vl"
