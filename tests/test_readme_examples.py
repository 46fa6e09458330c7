"""The README's and the docs' code runs as written: Python snippets are executed (the real-model ones on the
embedded models, same code otherwise), every ``vtprune`` name they use exists, and every documented
``vtprune ...`` command line parses."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest
import torch

import vtprune
from vtprune.models.embedded import embedded_model_path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# pages whose commands are checked: the docs, the committed results' pages and the model cards
COMMAND_PAGES = [*DOCS, *sorted((ROOT / "docs" / "results").rglob("*.md")),
                 *sorted((ROOT / "vtprune" / "models").glob("*/README.md"))]


def _block(name: str, path: Path = README) -> str:
    block = re.search(rf"<!-- {name} -->\n```python\n(.*?)```", path.read_text(), re.S)
    assert block, f"{path.name} lost its {name} block"
    return block.group(1)


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_embedded_example_runs_as_written(capsys):
    namespace: dict = {}
    with torch.inference_mode():
        exec(compile(_block("embedded-example"), "README.md:embedded-example", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert out[0] == namespace["sample"].questions[0].answer  # the embedded model answers this question right
    assert out[1] == "[16] [[4]]"
    assert not namespace["handle"].active  # removed: the model is pristine again


@pytest.mark.parametrize("name,spec,model,dtype,visual,stages", [
    ("llava-example", "llava-hf/llava-1.5-7b-hf", "llava", "float16", 16, [(2, 0.25)]),  # centre-cropped to 112 px
    ("qwen-example", "Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_vl", "bfloat16", 12,  # 150 x 112 px: 12 merged tokens
     [(1, 0.25 ** (1 / 3)), (2, 0.25 ** (2 / 3)), (3, 0.25)]),                     # PyramidDrop on 4 layers
])
def test_real_model_examples_run_on_the_embedded_models(tmp_path, capsys, name, spec, model, dtype, visual, stages):
    """The GPU snippets, with only the checkpoint, device, dtype and image file swapped (same family, same API)."""
    from vtprune.shapes.task import make_split

    code = _block(name)
    for real in (f'"{spec}"', '"cuda"', f'"{dtype}"', '"photo.jpg"'):
        assert code.count(real) == 1, f"{name}: expected {real} once"
    image = tmp_path / "photo.jpg"
    make_split("test", 1)[0].image.resize((150, 112)).save(image)  # not square, like a photo
    code = (code.replace(f'"{spec}"', repr(str(embedded_model_path(model)))).replace('"cuda"', '"cpu"')
            .replace(f'"{dtype}"', '"float32"').replace('"photo.jpg"', repr(str(image))))
    namespace: dict = {}
    with torch.inference_mode():
        exec(compile(code, f"README.md:{name}", "exec"), namespace)  # noqa: S102 - our own README
    stats = namespace["stats"]
    assert stats.visual_tokens == [visual] and stats.stage_layers == [layer for layer, _ in stages]
    assert stats.kept == [[vtprune.keep_count(keep, visual)] for _, keep in stages]
    assert namespace["handle"].active is False
    assert f"{stats.visual_tokens} {stats.stage_layers} {stats.kept}" in capsys.readouterr().out


def _names_used(code: str) -> tuple[set[str], set[tuple[str, str]]]:
    """``vtprune.X`` attributes, and ``(module, name)`` of ``from vtprune... import name``, in ``code``."""
    tree = ast.parse(code)
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Name) and node.value.id == "vtprune"}
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("vtprune") for alias in node.names}
    return attributes, imported


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_every_python_snippet_parses_and_uses_real_names(doc):
    for number, code in enumerate(_python_blocks(doc)):
        try:
            attributes, imported = _names_used(code)
        except SyntaxError as error:
            pytest.fail(f"{doc.name} python block {number}: {error}")
        for attribute in attributes:
            assert hasattr(vtprune, attribute), f"{doc.name} block {number}: vtprune.{attribute} does not exist"
        for module, name in imported:
            assert hasattr(importlib.import_module(module), name), f"{doc.name}: {module}.{name} does not exist"


def _command_lines(path: Path) -> list[list[str]]:
    """``vtprune ...`` commands of the ```bash blocks (continuations joined, comments dropped, ``NAME=value``
    prefixes dropped, ``$(vtprune ...)`` opened, ``$NAME`` replaced by the block's own ``NAME="..."``)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\$\((vtprune [^)]*)\)", r" \1", re.sub(r" \[[^\]]*\]", "", line))  # optional: [--json]
            line = re.sub(r"\$(\w+)", lambda m, known=variables: known.get(m.group(1), m.group(0)), line)
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"\w+=.*", words[0]):
                name, _, value = words.pop(0).partition("=")
                variables[name] = value
            if words[:1] == ["vtprune"] and len(words) > 1:
                commands.append(words[1:])
    return commands


def _inline_commands(path: Path) -> list[list[str]]:
    """Whole ``vtprune ...`` commands quoted inline (`` `vtprune bench ... --out X` ``) outside code blocks; synopses
    with placeholders (``KIND``, ``<folder>``, ``...``), ``--help`` and mentions of one option are left out."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    commands = []
    for span in re.findall(r"`(vtprune [^`]+)`", text):
        span = re.sub(r" \[[^\]]*\]", "", " ".join(span.split()))
        if re.search(r"\.\.\.|<\w+>|\b[A-Z]{3,}\b|: error", span):
            continue
        words = shlex.split(span)
        if any(word.startswith("--") for word in words) and "--help" not in words and not _option_mention(words):
            commands.append(words[1:])
    return commands


def _option_mention(words: list[str]) -> bool:
    """``vtprune run --video`` names an option in prose: one option, and it needs a value it is not given."""
    return len(words) == 3 and words[2] in {"--video", "--image", "--model", "--method"}


def _all_commands(path: Path) -> list[list[str]]:
    inline = [] if path.name == "serving.md" else _inline_commands(path)  # serving.md: its own page's checks
    return _command_lines(path) + inline


class _Parsed(Exception):
    """Raised in place of running a ``vtprune bench KIND`` main once its options parsed."""


def _parse_bench_kind(kind: str, module: str, argv: list[str], monkeypatch) -> None:
    """Parse ``argv`` with the parser of ``vtprune bench KIND``'s own main, without running it."""
    import argparse

    from vtprune.cli.commands import run_bench_kind

    def parse_and_stop(parser, args=None, namespace=None):
        _, extra = parser.parse_known_args(args, namespace)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        with pytest.raises(_Parsed):
            run_bench_kind(kind, module, argv)


@pytest.mark.parametrize("doc", COMMAND_PAGES, ids=[str(p.relative_to(ROOT)) for p in COMMAND_PAGES])
def test_every_documented_command_line_parses(doc, monkeypatch):
    from vtprune.cli import build_parser, parse_command
    from vtprune.cli.commands import bench_kind_main

    parser = build_parser()
    failed = []
    for words in _all_commands(doc):
        try:
            kind = bench_kind_main(words)  # `bench KIND ...`: the kind's own options
            parse_command(parser, words) if kind is None else _parse_bench_kind(*kind, monkeypatch)
        except SystemExit:
            failed.append(f"vtprune {' '.join(words)}")
    assert not failed, f"{doc.relative_to(ROOT)}: these do not parse: {failed}"


OUTPUT_OPTIONS = ("--out", "--workdir", "--curve")


def _outputs(words: list[str]) -> list[str]:
    """The paths a ``vtprune`` command line writes into: its output options, ``train-dense compact``'s DST,
    ``speed-report``'s folder when ``--merge`` replaces its CSV."""
    paths = [words[i + 1] for i, word in enumerate(words[:-1]) if word in OUTPUT_OPTIONS]
    if words[:3] == ["bench", "train-dense", "compact"] and len(words) > 4:
        paths.append(words[4])
    if words[:2] == ["bench", "speed-report"] and "--merge" in words and len(words) > 2:
        paths.append(words[2])
    return paths


@pytest.mark.parametrize("doc", COMMAND_PAGES, ids=[str(p.relative_to(ROOT)) for p in COMMAND_PAGES])
def test_documented_commands_that_replace_committed_files_say_force(doc):
    """A command writing into a committed file or folder (a shipped model, docs/results) is refused without
    ``--force`` since commands keep earlier results: the documented line must carry it to run as written."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    folders = {str(Path(name).parent) for name in tracked} | {str(parent) for name in tracked
                                                              for parent in Path(name).parents}
    missing = [" ".join(["vtprune", *words]) for words in _all_commands(doc) if "--force" not in words
               and any(str(Path(path)) in tracked or str(Path(path)) in folders for path in _outputs(words))]
    assert not missing, f"{doc.relative_to(ROOT)}: add --force (they replace committed files): {missing}"


def test_the_force_check_sees_each_way_of_naming_an_output():
    assert _outputs(["bench", "long", "--out", "docs/results/long-video-qwen2vl"]) == ["docs/results/long-video-qwen2vl"]
    assert _outputs(["bench", "train", "--workdir", "w", "--out", "m"]) == ["w", "m"]
    assert _outputs(["bench", "train-dense", "compact", "a.pt", "b.pt"]) == ["b.pt"]
    assert _outputs(["bench", "speed-report", "docs/results/speed-proxy"]) == []  # redrawn from its own CSV
    assert _outputs(["bench", "speed-report", "d", "--merge", "x.csv"]) == ["d"]


def test_readme_commands_use_schedules_the_default_model_has_room_for():
    from vtprune.config import parse_schedule, validate_stages

    for words in _command_lines(README):
        if "--schedule" in words and "--model" not in words:
            validate_stages(parse_schedule(words[words.index("--schedule") + 1]), 4)  # the embedded LM's depth


def test_video_example_runs_on_a_sampled_clip(tmp_path, monkeypatch, capsys):
    pytest.importorskip("av", reason="the video example needs PyAV, the optional [video] extra (installed by test.sh)")
    from vtprune.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["sample", "--video", "clip.mp4"]) == 0
    namespace: dict = {}
    with torch.inference_mode():
        exec(compile(_block("video-example", ROOT / "docs" / "video.md"), "video.md", "exec"), namespace)  # noqa: S102
    result = namespace["result"]
    assert result.answer == "green" and set(result.frames_selected) & {0, 1}  # the cross shows in frames 0-1
