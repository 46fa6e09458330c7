"""The vLLM version shims and the private-API check, in the main venv (no vLLM): fake objects and a hand-made tree.

The same check runs on the installed vLLM in tests/vllm/test_api_check.py, and on vLLM 0.33's unpacked wheel by
hand (docs/serving.md).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from vtprune.vllm import api_check
from vtprune.vllm.versions import build_metadata


class Builder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def build(self, common_prefix_len: int, common_attn_metadata: object, fast_build: bool = False) -> str:
        self.calls.append((common_prefix_len, common_attn_metadata, fast_build))
        return "built"


class GroupWithBuild:  # vLLM 0.32 and 0.33: AttentionGroup.build_metadata
    def __init__(self) -> None:
        self.calls: list[object] = []

    def build_metadata(self, common_attn_metadata: object, ubatch_idx: int = 0) -> str:
        self.calls.append(common_attn_metadata)
        return "mapped"


class GroupWithoutBuild:  # vLLM 0.31: only the builders
    def __init__(self) -> None:
        self.builder = Builder()

    def get_metadata_builder(self, ubatch_id: int = 0) -> Builder:
        return self.builder


def test_build_metadata_uses_the_groups_own_method_where_it_has_one():
    group, common = GroupWithBuild(), object()
    assert build_metadata(group, common) == "mapped"
    assert group.calls == [common]


def test_build_metadata_calls_the_builder_as_vllm_0_31s_runner_does():
    group, common = GroupWithoutBuild(), object()
    assert build_metadata(group, common) == "built"
    assert group.builder.calls == [(0, common, False)]  # no cascade prefix, a full build


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def fake_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A vllm folder and a plugin folder that imports from it: one name re-exported through ``import *``, one
    name missing."""
    vllm, plugin = tmp_path / "vllm", tmp_path / "pkg" / "plugin"
    write(vllm, {"__init__.py": "", "distributed/__init__.py": "from .state import *\n",
                 "distributed/state.py": "def get_tp_group():\n    pass\n",
                 "v1/kv.py": "class Manager:\n    def allocate(self, request_id, num_tokens):\n        self.pool = 1\n"})
    write(plugin, {"__init__.py": "", "a.py": "from vllm.distributed import get_tp_group\nfrom vllm.v1.kv import Gone\n"})
    return vllm, plugin


def test_imports_are_found_through_star_reexports_and_missing_names_are_named(tmp_path):
    vllm, plugin = fake_tree(tmp_path)
    results = dict(api_check.check_tree(vllm, plugin_dir=plugin))
    assert results["pkg/plugin/a.py: from vllm.distributed import get_tp_group"] == ""
    assert results["pkg/plugin/a.py: from vllm.v1.kv import Gone"] == "vllm.v1.kv does not define Gone"


def test_members_check_parameter_names_attributes_and_alternatives(tmp_path):
    vllm, _ = fake_tree(tmp_path)

    def check(name: str, params: tuple[str, ...] | None = None, alternative: str = "") -> str:
        return api_check.check_member(vllm, api_check.Member("v1/kv.py", "Manager", name, params, alternative))

    assert check("allocate", ("self", "request_id", "num_tokens")) == ""
    assert check("allocate", ("self", "", "num_tokens")) == ""  # "" matches any name
    assert "does not start with" in check("allocate", ("self", "request_id", "num_tokens_main_model"))
    assert check("pool") == ""  # a self.pool = ... attribute
    assert check("build", ("self",)) == "Manager has no build"
    assert check("build", ("self",), alternative="allocate") == "(as allocate)"
    assert api_check.check_member(vllm, api_check.Member("v1/kv.py", "Other", "x")) == "no class Other in vllm/v1/kv.py"


def test_the_real_plugins_imports_are_all_listed():
    """Every seam module's vLLM import is checked (a new seam cannot slip past the check)."""
    sources = {source for source, _, _ in api_check.plugin_imports()}
    assert {"vtprune/vllm/layerwise/kv.py", "vtprune/vllm/layerwise/metadata.py", "vtprune/vllm/qwen.py",
            "vtprune/vllm/layerwise/scheduler.py"} <= sources
    assert ("vtprune/vllm/layerwise/kv.py", "vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry") in \
        api_check.plugin_imports()


def test_main_reports_and_fails_on_a_missing_name(tmp_path, capsys):
    vllm, plugin = fake_tree(tmp_path)
    (vllm / "_version.py").write_text("__version__ = '0.99.0'\n")
    assert api_check.version_of(vllm) == "0.99.0"
    assert api_check.main([str(vllm)]) == 1  # the real plugin's imports are not in the fake tree
    out = capsys.readouterr().out
    assert "MISSING" in out and "vLLM 0.99.0 at" in out


def test_the_smoke_subset_in_test_sh_names_existing_tests_and_a_tested_minor():
    """test.sh's VLLM_SMOKE entries name test files and functions that exist (a rename cannot empty the smoke run),
    and the previous minor it installs is in the tested set."""
    import re

    from vtprune.vllm.settings import TESTED_VLLM, version_tuple

    root = Path(__file__).resolve().parents[1]
    script = (root / "test.sh").read_text()
    block = re.search(r"^VLLM_SMOKE=\((.*?)\)$", script, re.S | re.M)
    assert block is not None
    entries = [e.strip('"') for e in block.group(1).split()]
    assert len(entries) >= 5
    for entry in entries:
        path, *parts = entry.split("::")
        text = (root / path).read_text()
        shared = "".join(p.read_text() for p in (root / "tests" / "vllm").glob("*.py"))  # inherited test methods
        for index, part in enumerate(parts):
            found = rf"^\s*(def|class) {re.escape(part.split('[')[0])}\b"
            assert re.search(found, text if index == 0 else shared, re.M), entry
    previous = re.search(r"VLLM_PREV=\$\{VTPRUNE_VLLM_PREV:-([0-9.]+)\}", script)
    assert previous is not None and version_tuple(previous.group(1)) in TESTED_VLLM
