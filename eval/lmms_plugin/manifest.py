"""lmms-eval model manifests for the ``lmms_eval.models`` entry point (see ``pyproject.toml``).

lmms-eval loads every entry point on each run, so this module imports nothing heavy: the model classes
(and torch) are imported only when ``--model vtprune_llava`` / ``--model vtprune_qwen_vl`` is requested.
"""

from __future__ import annotations

from lmms_eval.models.registry_v2 import ModelManifest

MODELS_MODULE = "vtprune.eval.lmms_plugin.models"

MANIFESTS: tuple[ModelManifest, ...] = (
    ModelManifest(model_id="vtprune_llava", simple_class_path=f"{MODELS_MODULE}.VTPruneLlava"),
    ModelManifest(model_id="vtprune_qwen_vl", simple_class_path=f"{MODELS_MODULE}.VTPruneQwenVL"),
)
