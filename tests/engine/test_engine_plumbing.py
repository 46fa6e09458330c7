"""How the engine's parts are plumbed: the configuration is frozen, the plan is the one source of budgets, the
prefill / decode / KV helpers take the plan, the adapter and the call (never the handle), the call state is data
only and the stage step is short. Each check reads the source (or the objects), not the engine's results."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from vtprune.config import PruneConfig

ROOT = Path(__file__).resolve().parents[2]


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


ENGINE_PARTS = ("prefill", "decode", "kv", "guards")
LIBRARY = tuple(f"vtprune/{name}" for name in ("methods/", "engine", "prefill", "decode", "kv", "state", "calls",
                                               "scoring", "guards", "outputs", "layout", "api"))
KV_SETTINGS = {"retains_kv", "scope", "start", "distance", "decode", "profile", "counting"}


def test_the_engine_parts_never_see_the_handle():
    """prefill / decode / kv / guards import nothing of ``vtprune.engine`` (``TYPE_CHECKING`` included) and no
    function of theirs takes a ``PruneHandle``: they take the plan's ``Wiring`` (or the plan) and the call."""
    for part in ENGINE_PARTS:
        tree = _tree(part)
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        handles = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                   for arg in node.args.args if arg.annotation is not None and "PruneHandle" in ast.unparse(arg.annotation)]
        assert "vtprune.engine" not in imported and handles == [], (part, handles)


def test_the_engine_reads_kv_retention_off_the_plan_only():
    """No engine module reads a KV-retention setting off the scorer (``scorer.scope``, ``getattr(scorer, "profile")``)."""
    reads = []
    for part in ("engine", *ENGINE_PARTS):
        for node in ast.walk(_tree(part)):
            if isinstance(node, ast.Attribute) and node.attr in KV_SETTINGS and "scorer" in ast.unparse(node.value):
                reads.append(f"{part}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in KV_SETTINGS and "scorer" in ast.unparse(node.args[0]):
                    reads.append(f"{part}: {ast.unparse(node)}")
    assert reads == []


def test_the_plan_carries_the_scorers_kv_retention():
    import vtprune
    from vtprune.methods.base import KVRetention
    from vtprune.models.tiny import tiny_model

    model, _ = tiny_model("llava", "sdpa", image_size=112)
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt", start=2) as handle:
        assert handle.plan.kv.retention == KVRetention(scope="prompt", start=2) == handle.scorer.kv_retention()
        assert (handle.plan.kv.keep, handle.plan.kv.ratios, handle.retains_kv) == (0.5, None, True)
    with vtprune.apply(model, "fastv", keep=0.5) as handle:
        assert handle.plan.kv is None and handle.scorer.kv_retention() is None and not handle.retains_kv


def test_budgets_are_counted_by_the_config_and_the_plan_only():
    """``keep_count`` / ``truncated_count`` are called and ``config.keep`` is read only in ``config`` and ``plan``
    in the library (engine and methods): a group's quota is ``ScoreContext.kept_count``, the plan's rule."""
    found = []
    for path in sorted((ROOT / "vtprune").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("vtprune/config.py", "vtprune/plan.py") or not rel.startswith(LIBRARY):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("keep_count", "truncated_count"):
                found.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "keep" and ast.unparse(node.value).endswith("config"):
                found.append(f"{rel}:{node.lineno}")
    assert found == []
