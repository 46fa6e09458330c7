"""How the engine's parts are plumbed: the configuration is frozen, the plan is the one source of budgets, the
prefill / decode / KV helpers take the plan, the adapter and the call (never the handle), the call state is data
only and the stage step is short. Each check reads the source (or the objects), not the engine's results."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from vtprune.config import PruneConfig

ROOT = Path(__file__).resolve().parent.parent


def test_prune_config_is_frozen_and_replace_derives_a_checked_copy():
    config = PruneConfig(method="fastv+debias", keep=0.5, layer=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.keep = 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "pdrop"
    changed = dataclasses.replace(config, keep=0.25)
    assert (changed.method, changed.debias, changed.keep, changed.stages[0].keep) == ("fastv", True, 0.25, 0.25)
    assert (config.keep, config.stages[0].keep) == (0.5, 0.5)
    with pytest.raises(ValueError, match="keep must be in"):
        dataclasses.replace(config, keep=1.5)


def _tree(module: str) -> ast.Module:
    return ast.parse((ROOT / "vtprune" / f"{module}.py").read_text())


def test_state_holds_data_only():
    """``vtprune/state.py`` defines classes only and imports no selection machinery (kernels, layout)."""
    tree = _tree("state")
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert functions == [] and not imported & {"vtprune.kernels", "vtprune.layout"}, (functions, imported)


def test_the_stage_step_is_short():
    """``prefill.select`` is a stage step of at most 25 lines; its jobs are named functions."""
    select = next(node for node in _tree("prefill").body if isinstance(node, ast.FunctionDef) and node.name == "select")
    assert select.end_lineno - select.lineno + 1 <= 25
