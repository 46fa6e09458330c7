"""The import graph of vtprune: internal imports, imports inside functions, type-only imports, cycles, and
violations of the layer directions.

``python scripts/import_graph.py [--root DIR] [--dot FILE]`` prints counts (modules, internal imports, those
inside functions, type-only ones, cycles), then every violation: a core module importing an application, a
module under ``vtprune/`` importing ``vtprune.eval``, an unclassified module, and the import cycles
(``TYPE_CHECKING`` edges included).

Modules are named from their path *relative to the checkout* (``ROOT``, or ``--root``), so the folder the clone
sits in changes nothing. ``tests/test_architecture.py`` runs these checks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"vtprune": "vtprune", "vtprune.adapters": "adapters", "vtprune.kernels": "kernels", "vtprune.eval": "eval"}
CORE = ("vtprune.api", "vtprune.config", "vtprune.plan", "vtprune.engine", "vtprune.prefill", "vtprune.decode",
        "vtprune.calls", "vtprune.state", "vtprune.layout", "vtprune.scoring", "vtprune.methods", "vtprune.errors",
        "vtprune.calibration_check", "vtprune.method_config", "vtprune.flops", "vtprune.kv", "vtprune.outputs",
        "vtprune.guards", "vtprune.kv_priority", "vtprune.adapters", "vtprune.kernels")
APPLICATIONS = ("vtprune.__main__", "vtprune.cli", "vtprune.models", "vtprune.shapes", "vtprune.media",
                "vtprune.gridprobe", "vtprune.demo", "vtprune.vllm", "vtprune.eval")
EVAL = "vtprune.eval"


class Edge(NamedTuple):
    """One import statement: ``source`` imports ``target`` (inside a function? under ``if TYPE_CHECKING``?)."""

    source: str
    target: str
    nested: bool
    type_only: bool


def within(name: str, packages: tuple[str, ...] | str) -> bool:
    """Is module ``name`` one of ``packages`` or inside one of them?"""
    packages = (packages,) if isinstance(packages, str) else packages
    return any(name == p or name.startswith(p + ".") for p in packages)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{module name: file}`` for every ``.py`` file of the four package folders under ``root``."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")  # relative: the clone's location is irrelevant
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "vtprune" and parts and parts[0] in ("adapters", "kernels", "eval"):
                continue  # installed copies of the root folders, if any
            found[".".join([package, *parts]) if parts else package] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, bool, bool]]:
    """``(imported internal module, inside a function?, under TYPE_CHECKING?)`` for each import of ``path``."""
    tree = ast.parse(path.read_text())
    result = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def visit(node: ast.AST, nested: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            typed = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                result.extend((_resolve(a.name, known), inner, typed) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    head = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(head + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    result.append((_resolve(full if full in known else base, known), inner, typed))
            visit(child, inner, typed)

    visit(tree, False, False)
    return [(target, inner, typed) for target, inner, typed in result if target and target != name]


def _resolve(target: str, known: set[str]) -> str | None:
    while target and target not in known:
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return target or None


def edges(root: Path = ROOT) -> tuple[dict[str, Path], list[Edge]]:
    """The modules under ``root`` and every internal import statement between them."""
    found = modules(root)
    known = set(found)
    return found, [Edge(name, *item) for name, path in found.items() for item in imports(path, name, known)]


def graph_of(all_edges: list[Edge], skip: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    """``{module: imported modules}``, type-only edges included; ``skip`` leaves ``(source, target)`` pairs out."""
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in all_edges:
        if (edge.source, edge.target) not in skip:
            graph[edge.source].add(edge.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            strong(v)
    return out


def cycle_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The ``(source, target)`` pairs that lie inside an import cycle."""
    inside = set()
    for component in cycles(graph):
        members = set(component)
        inside |= {(a, b) for a in component for b in graph.get(a, ()) if b in members}
    return inside


def violations(found: dict[str, Path], all_edges: list[Edge], root: Path = ROOT) -> dict[str, set[tuple[str, str]]]:
    """``{rule: {(source, target)}}`` for the rules the tree must keep (``("module", "")`` for unclassified)."""
    in_folder = {name for name, path in found.items() if path.relative_to(root).parts[0] == "vtprune"}
    return {
        "core imports an application": {(e.source, e.target) for e in all_edges
                                        if within(e.source, CORE) and not within(e.target, CORE)},
        "vtprune/ imports vtprune.eval": {(e.source, e.target) for e in all_edges
                                          if e.source in in_folder and within(e.target, EVAL)},
        "unclassified module": {(m, "") for m in found if m != "vtprune" and not within(m, CORE + APPLICATIONS)},
        "import cycle": cycle_edges(graph_of(all_edges)),
    }


def report(root: Path = ROOT) -> list[str]:
    """The lines ``main`` prints: counts, then each rule's violations."""
    found, all_edges = edges(root)
    loops = cycles(graph_of(all_edges))
    lines = [f"modules {len(found)}, internal imports {len(all_edges)}, inside functions "
             f"{sum(e.nested for e in all_edges)}, type-only {sum(e.type_only for e in all_edges)}, "
             f"cycles {len(loops)} (type-only imports included)"]
    lines += ["  cycle: " + " <-> ".join(loop) for loop in loops]
    in_folder = {name for name, path in found.items() if path.relative_to(root).parts[0] == "vtprune"}
    statements = sum(e.source in in_folder and within(e.target, EVAL) for e in all_edges)
    for rule, pairs in violations(found, all_edges, root).items():
        extra = f" ({statements} import statements)" if rule.endswith("vtprune.eval") else ""
        lines.append(f"{rule}: {len(pairs)}{extra}")
        lines += [f"  {a} -> {b}" if b else f"  {a}" for a, b in sorted(pairs)]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    parser.add_argument("--dot", default=None, help="write a Graphviz drawing of the module graph here")
    args = parser.parse_args()
    print("\n".join(report(args.root.resolve())))
    if args.dot:
        graph = graph_of(edges(args.root.resolve())[1])
        lines = ["digraph vtprune {", "  rankdir=BT; node [shape=box, fontsize=10];"]
        lines += [f'  "{a}" -> "{b}";' for a in sorted(graph) for b in sorted(graph[a])]
        Path(args.dot).write_text("\n".join(lines + ["}"]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
