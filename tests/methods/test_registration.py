"""Built-in methods register themselves: ``import vtprune.methods`` alone registers every scorer class that a
module of the package declares. Checked in a fresh interpreter, so no other test's imports
can register a module that the package forgot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# After `import vtprune.methods` only: the registry; then every module of the package is imported by hand and
# each class declaring its own string `name` (a method; the abstract bases keep "custom") is listed.
CHECK = """
import importlib, inspect, json, pkgutil, sys
import vtprune.methods as package
from vtprune.methods.base import Scorer
registered = {name: f"{f.__module__}.{f.__qualname__}" for name, f in package.METHODS.items()}
declared = {}
for info in pkgutil.iter_modules(package.__path__):
    module = importlib.import_module(f"{package.__name__}.{info.name}")
    for cls in vars(module).values():
        name = vars(cls).get("name") if inspect.isclass(cls) else None
        if issubclass(cls, Scorer) if inspect.isclass(cls) else False:
            if cls.__module__ == module.__name__ and isinstance(name, str) and name != "custom":
                declared[name] = f"{cls.__module__}.{cls.__qualname__}"
print(json.dumps({"registered": registered, "declared": declared, "after": sorted(package.METHODS)}))
"""


def check(pythonpath: Path = ROOT) -> dict:
    """The registry right after ``import vtprune.methods`` and the methods the package's modules declare."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=pythonpath, capture_output=True, text=True,
                         check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_declared_method_is_registered_by_importing_the_package():
    found = check()
    missing = {name: where for name, where in found["declared"].items() if found["registered"].get(name) != where}
    assert missing == {}, "these scorer classes are not registered by `import vtprune.methods`"
    assert found["after"] == sorted(found["registered"])  # importing the modules by hand registers nothing more
    assert {"none", "fastv", "pdrop", "prefixkv", "visionzip", "dart", "temporal"} <= set(found["registered"])
