"""What users mistype, for every command and option: each is refused with one line that names the value (or the
flag and the file), a non-zero exit status, no traceback and no usage block, before any model loads or any
work starts.

Each case runs ``vtprune.cli.main(argv)`` in this process from an empty working folder. Placeholders in the
arguments: ``{file}`` a text file, ``{dir}`` a folder with a file in it, ``{empty}`` an empty folder, ``{photo}``
an existing photo, ``{csv}`` / ``{json}`` a file that is not what the option reads, ``{busy}`` a port a socket
listens on, ``{clip}`` a file named like a video. A case that loads a model, starts vLLM (a fake one here) or
runs longer than :data:`LIMIT_S` fails.
"""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import pytest

LIMIT_S = 60  # a refusal takes well under a second once the modules are imported

BATTERY: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    # vtprune run (images)
    "run": [
        ("--keep 0", ("--keep", "'0'")), ("--keep 1.5", ("--keep", "1.5")), ("--keep abc", ("--keep", "abc")),
        ("--keep nan", ("--keep", "nan")), ("--keep -0.25", ("--keep", "-0.25")),
        ("--sample -1", ("--sample", "-1")), ("--sample 10000", ("--sample", "10000")),
        ("--max-new-tokens 0", ("--max-new-tokens", "0")), ("--layer -1", ("--layer", "-1")),
        ("--layer 1.5", ("--layer", "1.5")), ("--layer 99", ("--layer 99",)),
        ("--schedule abc", ("--schedule", "abc")), ("--schedule 3:0.5,1:0.25", ("1",)),
        ("--schedule 1:2", ("2",)), ("--schedule 1:0.5,9:0.25", ("9",)),
        ("--method bogus", ("bogus",)), ("--method=", ("--method",)), ("--method fastv+bogus", ("bogus",)),
        ("--method fastv --fastv-k 3", ("--fastv-k",)), ("--image {tmp}/missing.png", ("missing.png",)),
        ("--image {dir}", ("dir",)), ("--image {file}", ("notes.txt",)), ("--question=", ("--question",)),
        ("--question <image>What?", ("<image>",)), ("--model /no/such/model", ("/no/such/model",)),
        ("--model tiny:bogus", ("tiny:bogus",)), ("--model {empty}", ("empty",)), ("--device gpu", ("gpu",)),
        ("--device cuda", ("cuda",)), ("--attn bogus", ("bogus",)), ("--dtype float8", ("float8",)),
        ("--parity bogus", ("bogus",)), ("--rounding bogus", ("bogus",)),
        ("--config {tmp}/missing.json", ("missing.json",)), ("--config {json}", ("broken.json",)),
        ("--config {dir}", ("dir",)), ("--debias {tmp}/nope.json", ("nope.json",)),
        ("--image {photo} --video {clip}", ("--video",)), ("--options A)x;B)y", ("--options",)),
        ("--parity release --method random", ("random",)), ("--bogus-flag", ("--bogus-flag",)),
        ("--image {photo}", ("photo.jpg",)), ("--schedule 1:0.5,1:0.25", ("--schedule",)),
        ("--schedule=", ("--schedule",)), ("--layer 1 --schedule 1:0.5", ("layer",)), ("--sample 1.5", ("1.5",)),
        ("--max-new-tokens 5000", ("5000",)), ("--keep 0.5 --config {tmp}/missing.json", ("missing.json",)),
    ],
    # vtprune run --video
    "run --video {clip} --question q": [
        ("--frames 0", ("--frames", "0")), ("--frames 300", ("--frames", "300")),
        ("--gridprobe 0", ("--gridprobe", "0")), ("--gridprobe 17", ("--gridprobe", "17")),
        ("--probe-pixels 10", ("--probe-pixels", "10")), ("--frame-budget bogus", ("bogus",)),
        ("--video-backend bogus", ("bogus",)), ("--route bogus", ("bogus",)),
        ("--selector /no/such/model", ("/no/such/model",)), ("--question=", ("--question",)),
        ("--model tiny:bogus", ("tiny:bogus",)), ("", ("clip.mp4",)), ("--options=", ("--options",)),
        ("--frames abc", ("abc",)),
    ],
    "run --question q": [("--video {tmp}/missing.mp4", ("missing.mp4",)), ("--video {dir}", ("dir",))],
    "sample": [
        ("", ("--image",)), ("--image {photo}", ("photo.jpg", "--force")), ("--image {dir}", ("dir",)),
        ("--image {tmp}/new.jpg", ("new.jpg",)), ("--video {tmp}/clip.txt", ("clip.txt",)),
        ("--index -1", ("--index", "-1")), ("--index abc", ("--index", "abc")), ("--image=", ("--image",)),
        ("--index 1.5", ("1.5",)), ("--image {tmp}/a.png --video {tmp}/a.png", ("a.png",)),
        ("--image {file}/x.png", ("x.png",)), ("--video {photo}", ("photo.jpg",)),
    ],
    "info": [("--bogus", ("--bogus",))],
    "bogus-command": [("", ("bogus-command",))],
    "--bogus": [("", ("--bogus",))],
    "bench": [
        ("--methods=", ("--methods",)), ("--methods ,", ("--methods",)), ("--methods bogus", ("bogus",)),
        ("--methods fastv,bogus", ("bogus",)), ("--keep=", ("--keep",)), ("--keep 0", ("--keep", "0")),
        ("--keep abc", ("abc",)), ("--keep 1.5", ("1.5",)), ("--images 0", ("--images", "0")),
        ("--batch-size 0", ("--batch-size", "0")), ("--timing-samples 0", ("--timing-samples", "0")),
        ("--repeats 0", ("--repeats", "0")), ("--threads -1", ("--threads", "-1")), ("--split bogus", ("bogus",)),
        ("--task bogus", ("bogus",)), ("--out {file}", ("notes.txt",)), ("--model /no/such", ("/no/such",)),
        ("--device cuda", ("cuda",)), ("bogus-kind", ("bogus-kind",)), ("--attn bogus", ("bogus",)),
        ("--threads abc", ("abc",)), ("--keep 1,abc", ("abc",)), ("long --out {tmp}/x --bogus", ("--bogus",)),
    ],
    "bench speed": [
        ("--speed-tokens bogus", ("bogus",)), ("--speed-batches 0", ("--speed-batches", "0")),
        ("--speed-batches abc", ("abc",)), ("--speed-new-tokens 1", ("--speed-new-tokens", "1")),
        ("--speed-hidden 0", ("--speed-hidden", "0")), ("--speed-layers 0", ("--speed-layers", "0")),
        ("--speed-max-spread 0.5", ("--speed-max-spread", "0.5")), ("--speed-budget-s -5", ("--speed-budget-s", "-5")),
        ("--speed-lm bogus", ("bogus",)), ("--methods bogus", ("bogus",)), ("--layer -1", ("--layer", "-1")),
        ("--out {file}", ("notes.txt",)), ("--keep 0", ("--keep", "0")), ("--speed-tokens=", ("--speed-tokens",)),
    ],
    "bench video": [
        ("--clips 0", ("--clips", "0")), ("--k 0", ("--k", "0")), ("--k 17", ("--k", "17")),
        ("--probe-pixels 10", ("--probe-pixels", "10")), ("--methods bogus", ("bogus",)),
        ("--answer bogus", ("bogus",)), ("--route bogus", ("bogus",)), ("--out {file}", ("notes.txt",)),
    ],
    "bench long --out {tmp}/long": [
        ("--setting bogus", ("bogus",)), ("--methods bogus", ("bogus",)), ("--keep 1", ("--keep", "1")),
        ("--clips 0", ("--clips", "0")), ("--frames -1", ("--frames", "-1")),
        ("--setting multi --images 0", ("--images", "0")), ("--setting multi --images 17", ("--images", "17")),
        ("--sets 0", ("--sets", "0")), ("--k 0", ("--k", "0")), ("--debias-file {tmp}/nope.json", ("nope.json",)),
        ("--threads 0", ("--threads", "0")), ("--out {file}", ("notes.txt",)), ("--methods=", ("--methods",)),
        ("--setting multi --methods gridprobe@4", ("gridprobe",)), ("--frames=", ("--frames",)),
        ("--keep=", ("--keep",)), ("--split bogus", ("bogus",)), ("--methods fastv@bogus", ("bogus",)),
    ],
    "bench long": [("", ("--out",))],
    "bench long-debias": [
        ("", ("files",)), ("{tmp}/missing.json", ("missing.json",)), ("{json}", ("broken.json",)),
        ("{dir}", ("dir",)), ("{json} --out {dir}", ("dir",)), ("{json} --curve {file}", ("notes.txt",)),
    ],
    "bench followup": [
        ("--images 0", ("--images", "0")), ("--threads -2", ("--threads", "-2")), ("--methods=", ("--methods",)),
        ("--methods bogus", ("bogus",)), ("--keep 0", ("--keep", "0")), ("--keep 2", ("--keep", "2")),
        ("--out {file}", ("notes.txt",)), ("--model /no/such", ("/no/such",)), ("--images abc", ("abc",)),
        ("--keep nan", ("nan",)), ("--methods fastv,bogus", ("bogus",)),
    ],
    "bench tower-queries --out {tmp}/q": [
        ("--towers bogus", ("bogus",)), ("--towers=", ("--towers",)), ("--towers random,bogus", ("bogus",)),
        ("--side 3", ("--side", "3")), ("--side 1", ("--side", "1")), ("--repeats 0", ("--repeats", "0")),
        ("--threads 0", ("--threads", "0")), ("--out {file}", ("notes.txt",)), ("--side 130", ("130",)),
        ("--repeats 21", ("21",)),
    ],
    "bench tower-queries": [("", ("--out",))],
    "bench footprint": [
        ("--threads 0", ("--threads", "0")), ("--calls 0", ("--calls", "0")), ("--new-tokens 0", ("--new-tokens", "0")),
        ("--methods bogus", ("bogus",)), ("--methods=", ("--methods",)), ("--methods random@x", ("random@x",)),
        ("--out {file}", ("notes.txt",)), ("--model /no/such", ("/no/such",)),
    ],
    "bench speed-report": [
        ("", ("folder",)), ("{tmp}/nothing", ("nothing",)), ("{garbage}", ("speed.csv",)), ("{file}", ("notes.txt",)),
        ("{tmp}/r --merge {tmp}/missing.csv", ("missing.csv",)), ("{tmp}/r --merge {csv}", ("table.csv",)),
        ("{garbage} --max-spread 0", ("--max-spread", "0")), ("{tmp}/r --merge {photo}", ("photo.jpg",)),
    ],
    "bench kernels --out {tmp}/k": [
        ("--threads -1", ("--threads", "-1")), ("--batch 0", ("--batch", "0")), ("--batch 1 -3", ("--batch", "-3")),
        ("--max-gib 0", ("--max-gib", "0")), ("--max-gib -1", ("--max-gib", "-1")), ("--device cuda", ("cuda",)),
        ("--out {file}", ("notes.txt",)), ("--kernels bogus", ("bogus",)), ("--preset bogus", ("bogus",)),
        ("--batch abc", ("abc",)), ("--kernels", ("--kernels",)),
    ],
    "bench plot-kernels": [
        ("--csv {tmp}/missing.csv", ("missing.csv",)), ("--csv {csv}", ("table.csv",)), ("--out {empty}", ("empty",)),
        ("--csv {dir}", ("dir",)), ("--csv {photo}", ("photo.jpg",)),
    ],
    "bench serving --out {tmp}/s": [
        ("--keep 0", ("--keep", "0")), ("--keep abc", ("abc",)), ("--concurrency abc", ("abc",)),
        ("--concurrency 0", ("--concurrency", "0")), ("--concurrency=", ("--concurrency",)),
        ("--requests 0", ("--requests", "0")), ("--max-tokens 0", ("--max-tokens", "0")),
        ("--rounds 0", ("--rounds", "0")), ("--transformers-requests -1", ("--transformers-requests", "-1")),
        ("--max-model-len 0", ("--max-model-len", "0")), ("--method bogus", ("bogus",)), ("--method oracle", ("oracle",)),
        ("--models bogus", ("bogus",)), ("--plot-only {empty}", ("empty",)), ("--out {file}", ("notes.txt",)),
        ("--dtype float8", ("float8",)), ("--models=", ("--models",)), ("--keep 1.5", ("1.5",)),
    ],
    "bench train --workdir {tmp}/w": [
        ("--steps -1", ("--steps", "-1")), ("--steps 0", ("--steps", "0")), ("--minutes -1", ("--minutes", "-1")),
        ("--minutes 0", ("--minutes", "0")), ("", ("--minutes",)), ("--steps 1 --batch 0", ("--batch", "0")),
        ("--steps 1 --lr 0", ("--lr", "0")), ("--steps 1 --lr nan", ("--lr", "nan")),
        ("--steps 1 --threads 0", ("--threads", "0")), ("--steps 1 --arch bogus", ("bogus",)),
        ("--steps 1 --task dense --arch qwen2_vl", ("--task dense",)), ("--steps 1 --finish", ("--finish",)),
        ("--steps 1 --video-clips -1", ("--video-clips", "-1")), ("--steps 1 --image-size 0", ("--image-size", "0")),
        ("--steps 1 --patch-size 0", ("--patch-size", "0")), ("--steps 1 --layers 0", ("--layers", "0")),
        ("--steps 1 --warmup -1", ("--warmup", "-1")), ("--steps 1 --log-every 0", ("--log-every", "0")),
        ("--steps 1 --export-every 0", ("--export-every", "0")), ("--steps 1 --val-images 0", ("--val-images", "0")),
        ("--steps 1 --test-images 0", ("--test-images", "0")),
        ("--steps 1 --resume-from {tmp}/nope.pt", ("nope.pt",)), ("--steps 1 --init-from {tmp}/nope", ("nope",)),
        ("--steps 1 --out {file}", ("notes.txt",)), ("--steps abc", ("abc",)),
        ("--steps 1 --video-clips 2", ("--video-clips",)), ("--minutes abc", ("abc",)),
        ("--steps 1 --lr abc", ("abc",)), ("--steps 1 --leg-minutes 0", ("--leg-minutes", "0")),
    ],
    "bench train-dense": [
        ("compact {tmp}/missing.pt {tmp}/dst.pt", ("missing.pt",)), ("compact {file} {tmp}/dst.pt", ("notes.txt",)),
        ("bogus a b", ("bogus",)), ("compact {file} {dir}", ("dir",)),
    ],
    "calibrate --out {tmp}/c.json": [
        ("--n 0", ("--n", "0")), ("--video --frames 1", ("--frames", "1")), ("--layer 0", ("--layer", "0")),
        ("--batch-size 0", ("--batch-size", "0")), ("--bins 0", ("--bins", "0")), ("--method bogus", ("bogus",)),
        ("--scope bogus", ("bogus",)), ("--data {tmp}/no_images", ("no_images",)), ("--out {tmp}/c.png", ("c.png",)),
        ("--out {dir}", ("dir",)), ("--video --data {dir}", ("--data",)),
        ("--images-per-prompt 0", ("--images-per-prompt", "0")), ("--video --images-per-prompt 2", ("--video",)),
        ("--model /no/such", ("/no/such",)), ("--n abc", ("abc",)), ("--data {file}", ("notes.txt",)),
        ("--data {empty}", ("empty",)),
    ],
    "calibrate": [("", ("--out",))],
    "tune --out {tmp}/t.json": [
        ("--trials 0", ("--trials", "0")), ("--budget 0", ("0",)), ("--method bogus", ("bogus",)),
        ("--n-samples 0", ("--n-samples", "0")), ("--seed -1", ("--seed", "-1")), ("--out {dir}", ("dir",)),
        ("--batch-size 0", ("--batch-size", "0")), ("--model /no/such", ("/no/such",)), ("--budget 1.5", ("1.5",)),
        ("--trials abc", ("abc",)),
    ],
    "tune": [("", ("--out",))],
    "demo": [
        ("--port 0", ("--port", "0")), ("--port 70000", ("--port", "70000")), ("--port abc", ("abc",)),
        ("--model /no/such", ("/no/such",)), ("--port {busy}", ("{busy}",)),
        ("--host no-such-host.invalid", ("no-such-host.invalid",)), ("--port -1", ("-1",)),
        ("--device gpu", ("gpu",)),
    ],
    "serve": [
        ("--port 70000", ("--port", "70000")), ("--port 0", ("--port", "0")), ("--port abc", ("abc",)),
        ("--keep 0", ("0",)), ("--keep abc", ("abc",)), ("--keep nan", ("nan",)), ("--seed -1", ("--seed", "-1")),
        ("--method bogus", ("bogus",)), ("--method oracle", ("oracle",)), ("/no/such/folder", ("/no/such/folder",)),
        ("--port {busy}", ("{busy}",)), ("--host no-such-host.invalid", ("no-such-host.invalid",)),
        ("--keep 1.5", ("1.5",)), ("--keep -1", ("-1",)), ("--seed abc", ("abc",)),
    ],
}
CASES = [pytest.param(f"{command} {extra}".strip(), needles, id=f"{command} {extra}".strip())
         for command, rows in BATTERY.items() for extra, needles in rows]


@pytest.fixture
def places(tmp_path, monkeypatch) -> dict[str, str]:
    """The placeholders' paths, an empty working folder, a fake vLLM and a model loader that fails the case."""
    import vtprune.models.loading

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (tmp_path / "notes.txt").write_text("a text file\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inside.txt").write_text("x\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0 the user's photo")
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "clip.mp4").write_bytes(b"not a video at all\n" * 10)
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "speed.csv").write_bytes(b"\x00\x01garbage,,\n\xff\xfe")
    fake = tmp_path / "fake-vllm-python"
    fake.write_text("#!/bin/sh\necho 'the fake vLLM started' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VTPRUNE_VLLM_PYTHON", str(fake))
    monkeypatch.setattr(vtprune.models.loading, "load", _no_loading)
    names = {"file": "notes.txt", "dir": "dir", "empty": "empty", "photo": "photo.jpg", "csv": "table.csv",
             "json": "broken.json", "clip": "clip.mp4", "garbage": "garbage"}
    return {"tmp": str(tmp_path), **{key: str(tmp_path / name) for key, name in names.items()}}


def _no_loading(*args, **kwargs):
    raise AssertionError("a model was loaded: the bad input was not refused first")


class Overrun(BaseException):
    """The case ran past :data:`LIMIT_S` (a ``BaseException``: the benchmarks' ``except Exception`` cannot hide it)."""


def _timeout(signum, frame):
    raise Overrun(f"the case ran for {LIMIT_S} s: the bad input was not refused first")


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``vtprune ARGV`` in this process, within :data:`LIMIT_S`."""
    from vtprune.cli import main

    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(LIMIT_S)
    try:
        code = main(argv)
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) or error.code is None else 1
        if not isinstance(error.code, int | None):
            print(error.code, file=sys.stderr)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return int(code or 0), capsys.readouterr().err


@pytest.mark.parametrize("line,needles", CASES)
def test_a_mistyped_command_line_gets_one_clear_line(line, needles, places, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {**places, "busy": str(busy.getsockname()[1])}
        argv = [part.format(**values) for part in line.split(" ")]
        code, err = _run(argv, capsys)
    lines = [text for text in err.splitlines() if text.strip()]
    assert code != 0, f"exit status 0 for {argv}; stderr: {err!r}"
    assert len(lines) == 1 and "Traceback" not in err and "usage:" not in err, err
    for needle in needles:
        assert needle.format(**values) in lines[0], f"{needle!r} not named in: {lines[0]}"


def test_the_battery_covers_every_command():
    """Every ``vtprune`` command and ``vtprune bench`` kind has cases (the papers' kinds are tested apart)."""
    from vtprune.cli.commands import BENCH_KINDS, COMMANDS

    covered = {line.split(" ")[0] for line in BATTERY} | {" ".join(line.split(" ")[:2]) for line in BATTERY}
    apart = {"bench reproduce", "bench lmms-prepare", "bench accuracy"}  # accuracy: the "bench" cases
    missing = [name for name in COMMANDS if name not in covered]
    missing += [f"bench {kind}" for kind in BENCH_KINDS if f"bench {kind}" not in covered | apart]
    assert not missing and len(CASES) >= 200, (missing, len(CASES))


def test_placeholder_paths_exist(places):
    assert all(Path(places[key]).exists() for key in ("file", "dir", "empty", "photo", "csv", "json", "clip"))
