"""Packaging rules: the root folders install under vtprune, and importing vtprune changes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_root_folders_install_under_vtprune_only(tmp_path):
    code = ("import importlib.util as u, vtprune.kernels, vtprune.adapters, vtprune.eval\n"
            "print([u.find_spec(n) is None for n in ('kernels', 'adapters', 'eval')])\n"
            "print(vtprune.kernels.__file__)")
    lines = _python(code, str(tmp_path)).splitlines()
    assert lines[0] == "[True, True, True]"
    assert Path(lines[1]).resolve() == (ROOT / "kernels" / "__init__.py").resolve()


def test_pytest_and_the_install_resolve_the_same_modules():
    import vtprune.adapters
    import vtprune.kernels

    assert Path(vtprune.kernels.__file__).resolve().parent == (ROOT / "kernels").resolve()
    assert Path(vtprune.adapters.__file__).resolve().parent == (ROOT / "adapters").resolve()


def test_transformers_does_not_mistake_our_kernels_folder_for_the_hub_package():
    code = "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())"
    assert _python(code, str(ROOT)).strip() == "False"


def test_import_vtprune_changes_nothing_global(tmp_path):
    code = (
        "import sys, torch, transformers\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "before = (set(ALL_ATTENTION_FUNCTIONS.keys()), dict(torch.nn.modules.module._global_forward_pre_hooks),"
        " dict(torch.nn.modules.module._global_forward_hooks))\n"
        "import vtprune; vtprune.list_methods()\n"
        "after = (set(ALL_ATTENTION_FUNCTIONS.keys()), dict(torch.nn.modules.module._global_forward_pre_hooks),"
        " dict(torch.nn.modules.module._global_forward_hooks))\n"
        "print(before == after, any(m.startswith('vtprune.kernels._triton') for m in sys.modules))"
    )
    assert _python(code, str(tmp_path)).strip() == "True False"


def test_every_package_is_declared_and_ships_its_data(tmp_path):
    """A regular (non-editable) install: every folder with an __init__.py is a declared package, and the wheel
    carries the embedded models and the lmms-eval tasks."""
    import zipfile

    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"vtprune": ROOT / "vtprune", "vtprune.kernels": ROOT / "kernels", "vtprune.adapters": ROOT / "adapters",
             "vtprune.eval": ROOT / "eval"}
    found = set()
    for package, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            if package == "vtprune" and parts and parts[0] in ("kernels", "adapters", "eval"):
                continue
            found.add(".".join((package, *parts)))
    assert found == declared
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert "vtprune/models/vtprune-llava-shapes/model.safetensors" in names
    assert "vtprune/methods/fastv.py" in names and "vtprune/cli/__init__.py" in names
    assert any(n.startswith("vtprune/eval/lmms_plugin/tasks/vtprune_shapes/") for n in names)
