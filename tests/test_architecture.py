"""The core library never imports an application, and there is no import cycle (scripts/import_graph.py)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ("vtprune.api", "vtprune.config", "vtprune.plan", "vtprune.engine", "vtprune.prefill", "vtprune.decode",
        "vtprune.calls", "vtprune.state", "vtprune.layout", "vtprune.scoring", "vtprune.methods", "vtprune.errors",
        "vtprune.calibration_check", "vtprune.method_config", "vtprune.flops", "vtprune.kv", "vtprune.outputs", "vtprune.guards",
        "vtprune.adapters",
        "vtprune.kernels")
APPLICATIONS = ("vtprune.__main__", "vtprune.cli", "vtprune.models", "vtprune.media", "vtprune.gridprobe", "vtprune.demo", "vtprune.eval")
KNOWN_CYCLES: list[list[str]] = []


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    found = tool.modules()
    graph = defaultdict(set)
    for name, path in found.items():
        for target, _ in tool.imports(path, name, set(found)):
            graph[name].add(target)
    return tool, found, graph


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_core_never_imports_an_application_and_everything_is_classified():
    _, found, graph = _graph()
    upward = sorted((a, b) for a in graph for b in graph[a] if _within(a, CORE) and not _within(b, CORE))
    assert upward == []
    unclassified = sorted(m for m in found if m != "vtprune" and not _within(m, CORE + APPLICATIONS))
    assert unclassified == []


def test_no_import_cycles():
    tool, _, graph = _graph()
    assert [c for c in tool.cycles(graph) if c not in KNOWN_CYCLES] == []
