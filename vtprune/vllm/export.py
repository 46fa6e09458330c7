"""Model folders for vLLM: the embedded LLaVA in the llava-hf weight layout, exported on demand into a cache.

The embedded LLaVA names its CLIP tower ``vision_tower.embeddings...``; vLLM (and every llava-hf checkpoint)
expects ``vision_tower.vision_model.embeddings...``. :func:`llava_hf_names` is the renaming (pure);
:func:`export_embedded` writes the renamed copy once (transformers loads it to an identical state dict) and
returns its folder. The embedded Qwen2-VL loads as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

TOWER = "vision_tower."
HF_TOWER = "vision_tower.vision_model."


def llava_hf_names(names: Iterable[str]) -> dict[str, str]:
    """Old -> new weight name: tower keys (``vision_tower.*``, or ``model.vision_tower.*`` as transformers 5
    saves a LLaVA-family model) move under ``vision_tower.vision_model.``; others stay."""
    out = {}
    for name in names:
        prefix = "model." if name.startswith("model." + TOWER) else ""
        rest = name[len(prefix):]
        out[name] = (prefix + HF_TOWER + rest[len(TOWER):] if rest.startswith(TOWER) and not rest.startswith(HF_TOWER)
                     else name)
    return out


def rename_in_place(weights: Path) -> bool:
    """Rewrite a ``model.safetensors`` in the llava-hf layout if it is not; ``True`` if it was rewritten."""
    if all(old == new for old, new in llava_hf_names(_names(weights)).items()):
        return False
    staging = weights.with_name(weights.name + ".partial")
    _write_renamed(weights, staging)
    staging.replace(weights)
    return True


def cache_root() -> Path:
    """Where exported folders live: ``$VTPRUNE_CACHE`` or ``~/.cache/vtprune``, then ``vllm-models``."""
    return Path(os.environ.get("VTPRUNE_CACHE", Path.home() / ".cache" / "vtprune")) / "vllm-models"


def export_embedded(name: str = "llava", root: Path | None = None) -> Path:
    """Folder of embedded model ``name`` that vLLM loads (LLaVA: renamed once into the cache, keyed by content)."""
    from vtprune.models.embedded import embedded_model_path

    source = embedded_model_path(name)
    weights = source / "model.safetensors"
    if not any(n.startswith(TOWER) and not n.startswith(HF_TOWER) for n in _names(weights)):
        return source
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:12]
    target = (root or cache_root()) / f"{source.name}-hf-{digest}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and item.name != "model.safetensors":
                shutil.copy2(item, staging / item.name)
        _write_renamed(weights, staging / "model.safetensors")
        try:
            staging.rename(target)
        except OSError:  # another process exported it first
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _names(weights: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as handle:
        return list(handle.keys())


def _write_renamed(source: Path, target: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source))
    names = llava_hf_names(tensors)
    save_file({names[k]: v for k, v in tensors.items()}, str(target), metadata={"format": "pt"})


def model_folder(spec: str) -> str:
    """A model argument for vLLM: ``embedded:llava`` / ``embedded:qwen2_vl`` (or ``llava``...) -> a folder."""
    from vtprune.models.embedded import EMBEDDED_MODELS

    name = spec.removeprefix("embedded:")
    if spec.startswith("embedded:") or name in EMBEDDED_MODELS:
        if name not in EMBEDDED_MODELS:
            raise ValueError(f"vtprune: unknown embedded model {spec!r}; known: "
                             f"{', '.join('embedded:' + n for n in EMBEDDED_MODELS)}.")
        return str(export_embedded(name))
    return spec
