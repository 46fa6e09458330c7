"""The import graph of vtprune: internal imports, imports inside functions, cycles, and layer violations.

``python scripts/import_graph.py [--dot FILE]`` prints counts (the architecture issue's before/after numbers)
and, with ``--dot``, a Graphviz drawing of the module graph.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"vtprune": "vtprune", "vtprune.adapters": "adapters", "vtprune.kernels": "kernels", "vtprune.eval": "eval"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if folder == "vtprune" and any(part in ("models",) for part in path.parts):
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts]) if parts else package
            if folder == "vtprune" and parts and parts[0] in ("adapters", "kernels", "eval"):
                continue
            found[name] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, bool]]:
    """``(imported internal module, inside a function?)`` for every import statement of ``path``."""
    tree = ast.parse(path.read_text())
    result = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                result.extend((_resolve(a.name, known), inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    result.append((_resolve(full if full in known else base, known), inner))
            visit(child, inner)

    visit(tree, False)
    return [(target, inner) for target, inner in result if target and target != name]


def _resolve(target: str, known: set[str]) -> str | None:
    while target and target not in known:
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return target or None


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
    for v in graph:
        if v not in index:
            strong(v)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dot", default=None)
    parser.add_argument("--core", default="", help="comma-separated core modules: report imports from core to others")
    args = parser.parse_args()
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = defaultdict(set)
    total = inner = 0
    for name, path in found.items():
        for target, nested in imports(path, name, known):
            graph[name].add(target)
            total += 1
            inner += nested
    loops = cycles(graph)
    print(f"modules {len(found)}, internal imports {total}, inside functions {inner}, cycles {len(loops)}")
    for loop in loops:
        print("  cycle:", " <-> ".join(loop))
    if args.core:
        core = {c for c in args.core.split(",") if c}
        bad = [(a, b) for a in graph for b in graph[a] if any(a == c or a.startswith(c + ".") for c in core)
               and not any(b == c or b.startswith(c + ".") for c in core)]
        print(f"core -> application imports: {len(bad)}")
        for a, b in sorted(bad):
            print(f"  {a} -> {b}")
    if args.dot:
        lines = ["digraph vtprune {", "  rankdir=BT; node [shape=box, fontsize=10];"]
        lines += [f'  "{a}" -> "{b}";' for a in sorted(graph) for b in sorted(graph[a])]
        Path(args.dot).write_text("\n".join(lines + ["}"]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
