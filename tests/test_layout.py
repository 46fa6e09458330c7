"""The test tree mirrors the source tree: each test file sits in the folder of the part it
tests, ``tests/`` itself holds only project-wide checks (and the shared helpers), no two test files of the main
suite share a name, and no file under ``tests/`` is over 400 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# test folder -> the part of the checkout it tests
FOLDERS = {
    "engine": "vtprune/engine.py",  # the core modules beside it: api, plan, prefill, decode, kv, outputs, flops
    "methods": "vtprune/methods",
    "kernels": "kernels",
    "adapters": "adapters",
    "models": "vtprune/models",
    "shapes": "vtprune/shapes",
    "media": "vtprune/media",
    "gridprobe": "vtprune/gridprobe",
    "cli": "vtprune/cli",
    "demo": "vtprune/demo",
    "eval": "eval",
    "vllm": "vtprune/vllm",  # run in the vLLM venv (test.sh), not collected here
}
PROJECT_WIDE = {"test_architecture.py", "test_layout.py", "test_packaging.py", "test_project_files.py",
                "test_readme_examples.py", "test_vllm_plugin.py", "test_vllm_layerwise.py",
                "test_vllm_versions.py", "test_vllm_tower_rows.py", "test_vllm_decode_shift.py"}  # vLLM plugin: pure parts
NOT_TESTS = {"data", "__pycache__"}
MAX_LINES = 400


def layout_problems(tests: Path, root: Path) -> list[str]:
    """What breaks the layout of the test folder ``tests`` of the checkout ``root`` (empty: none)."""
    problems = [f"{p.name}: a test file at tests/ root (move it to the folder of what it tests)"
                for p in sorted(tests.glob("test_*.py")) if p.name not in PROJECT_WIDE]
    for folder in sorted(p for p in tests.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if folder.name in NOT_TESTS:
            continue
        if folder.name not in FOLDERS:
            problems.append(f"tests/{folder.name}/: names no part of the source (known: {sorted(FOLDERS)})")
        elif not (root / FOLDERS[folder.name]).exists():
            problems.append(f"tests/{folder.name}/: its source {FOLDERS[folder.name]} does not exist")
    return problems


def duplicate_names(tests: Path) -> list[str]:
    """Test file names that occur in more than one folder of the main suite (``tests/vllm`` aside)."""
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        if "vllm" not in path.relative_to(tests).parts[:-1]:
            seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    return sorted(f"{name}: {where}" for name, where in seen.items() if len(where) > 1)


def long_files(tests: Path) -> list[str]:
    """Python files under ``tests`` over :data:`MAX_LINES` lines, with their length."""
    lengths = {p: len(p.read_text().splitlines()) for p in tests.rglob("*.py")}
    return sorted(f"{p.relative_to(tests)}: {n}" for p, n in lengths.items() if n > MAX_LINES)


def test_each_test_file_sits_in_the_folder_of_what_it_tests() -> None:
    assert layout_problems(ROOT / "tests", ROOT) == []


def test_no_two_test_files_share_a_name() -> None:
    assert duplicate_names(ROOT / "tests") == []


def test_no_file_under_tests_is_over_400_lines() -> None:
    assert long_files(ROOT / "tests") == []


def test_the_checks_fail_on_a_flat_tree_and_a_stray_folder(tmp_path: Path) -> None:
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "tests" / "test_engine.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "tests" / "helpers" / "test_engine.py").write_text("")
    assert [p.split(":")[0] for p in layout_problems(tmp_path / "tests", tmp_path)] == ["test_engine.py",
                                                                                       "tests/helpers/"]
    assert len(duplicate_names(tmp_path / "tests")) == 1
    assert long_files(tmp_path / "tests") == [f"test_engine.py: {MAX_LINES + 1}"]
