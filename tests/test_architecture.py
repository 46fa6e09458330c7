"""The layer directions of the tree (scripts/import_graph.py): the core never imports an application, nothing
under ``vtprune/`` imports ``vtprune.eval``, every module is classified, and no import cycle exists, imports
under ``if TYPE_CHECKING`` included. Modules are named relative to the checkout, so a clone's location does
not matter (a clone under a folder named ``models/`` once skipped every module and passed)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

# Violations allowed for now, each to be removed with the import it names: any violation NOT listed here fails
# the test, and an entry that no longer occurs fails too (the list only shrinks). Both are empty: nothing under
# vtprune/ imports vtprune.eval (the synthetic task lives in vtprune.shapes), and no type-only import closes a
# cycle (the engine's parts take the plan's Wiring and the call, not the PruneHandle).
KNOWN_VIOLATIONS_TO_REMOVE: dict[str, set[tuple[str, str]]] = {
    "vtprune/ imports vtprune.eval": set(),
    "type-only edge closing a cycle": set(),
}


def _check(root: Path = ROOT, known: dict[str, set[tuple[str, str]]] | None = None) -> dict[str, set]:
    """``{rule: violations not in ``known``}`` for the checkout at ``root``; cycles with the allowed edges cut."""
    known = KNOWN_VIOLATIONS_TO_REMOVE if known is None else known
    found, edges = tool.edges(root)
    found_rules = tool.violations(found, edges, root)
    allowed_cuts = known.get("type-only edge closing a cycle", set())
    found_rules["import cycle"] = tool.cycle_edges(tool.graph_of(edges, skip=allowed_cuts))
    return {rule: pairs - known.get(rule, set()) for rule, pairs in found_rules.items()}


def test_no_new_violation_of_the_layer_directions():
    assert {rule: sorted(pairs) for rule, pairs in _check().items() if pairs} == {}


def test_every_allowance_still_occurs():
    """An entry whose import is gone must leave KNOWN_VIOLATIONS_TO_REMOVE (the list only shrinks)."""
    found, edges = tool.edges(ROOT)
    present = tool.violations(found, edges, ROOT)
    type_only = {(e.source, e.target) for e in edges if e.type_only}
    stale = sorted(KNOWN_VIOLATIONS_TO_REMOVE["vtprune/ imports vtprune.eval"] - present["vtprune/ imports vtprune.eval"])
    stale += sorted(KNOWN_VIOLATIONS_TO_REMOVE["type-only edge closing a cycle"] - (present["import cycle"] & type_only))
    assert stale == [], "remove these from KNOWN_VIOLATIONS_TO_REMOVE: the imports they allowed are gone"


def test_models_and_type_only_imports_are_read():
    found, edges = tool.edges(ROOT)
    assert "vtprune.models.vocabulary" in found and "vtprune.models.loading" in found
    assert tool.Edge("vtprune", "vtprune.engine", False, True) in edges  # the package's type-only re-exports
    assert tool.Edge("vtprune.models.vocabulary", "vtprune.shapes.task", True, False) in edges


def _not_python(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())]


def _copy_checkout(destination: Path) -> Path:
    """The package folders of this checkout (``.py`` files only) under ``destination``."""
    for folder in tool.PACKAGES.values():
        shutil.copytree(ROOT / folder, destination / folder, ignore=_not_python)
    return destination


@pytest.mark.parametrize("edit", [
    ("vtprune/config.py", "import vtprune.cli\n", "core imports an application"),  # cli imports config: a cycle too
    ("vtprune/kv.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vtprune.demo import app\n",
     "core imports an application"),
    ("vtprune/models/tiny.py", "from vtprune.eval import tune\n", "vtprune/ imports vtprune.eval"),
    ("vtprune/plan.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vtprune.api import wrap\n",
     "import cycle"),
])
def test_an_injected_violation_fails_in_a_clone_under_a_models_folder(tmp_path, edit):
    """A clone at ``.../models/clone`` with one injected import: the check names exactly that violation."""
    root = _copy_checkout(tmp_path / "models" / "clone")
    assert _check(root) == {rule: set() for rule in _check(root)}  # the copy itself is clean
    file, line, rule = edit
    (root / file).write_text(line + (root / file).read_text())
    broken = {name: pairs for name, pairs in _check(root).items() if pairs}
    assert rule in broken
    assert set(broken) <= {rule, "import cycle"}


def test_the_rules_on_a_synthetic_graph():
    root = Path("/models/checkout")
    found = {"vtprune.config": root / "vtprune/config.py", "vtprune.cli": root / "vtprune/cli/__init__.py",
             "vtprune.eval.shapes": root / "eval/shapes.py", "vtprune.eval.bench": root / "eval/bench.py",
             "vtprune.extra": root / "vtprune/extra.py"}
    edges = [tool.Edge("vtprune.config", "vtprune.cli", False, False),
             tool.Edge("vtprune.cli", "vtprune.eval.shapes", True, False),
             tool.Edge("vtprune.eval.bench", "vtprune.eval.shapes", False, False),
             tool.Edge("vtprune.eval.shapes", "vtprune.cli", False, True),
             tool.Edge("vtprune.cli", "vtprune.eval.bench", False, False)]
    rules = tool.violations(found, edges, root)
    assert rules["core imports an application"] == {("vtprune.config", "vtprune.cli")}
    assert rules["vtprune/ imports vtprune.eval"] == {("vtprune.cli", "vtprune.eval.shapes"),
                                                      ("vtprune.cli", "vtprune.eval.bench")}
    assert rules["unclassified module"] == {("vtprune.extra", "")}
    assert ("vtprune.eval.shapes", "vtprune.cli") in rules["import cycle"]


def test_the_readme_snippets_import_nothing_from_vtprune_eval():
    """A user's first code imports the library and the synthetic task (vtprune.shapes), not the benchmarks."""
    blocks = (ROOT / "README.md").read_text().split("```python")[1:]
    lines = [line.strip() for block in blocks for line in block.split("```")[0].splitlines()]
    assert [line for line in lines if line.startswith(("import vtprune.eval", "from vtprune.eval"))] == []
