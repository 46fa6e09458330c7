"""Nothing lost: a command that writes into a file or folder the user names never replaces what an earlier run
(or the user) left there. Without ``--force`` (or ``--resume`` where the run can continue) it refuses in one
line naming the file and the ways out, before any work, and the earlier file keeps every byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EARLIER = b"the results of an earlier run\n"
CALIBRATION = ROOT / "vtprune/models/vtprune-llava-shapes/calibration.json"
SPEED_CSV = ROOT / "docs/results/speed-proxy/speed.csv"

# (command line, the file an earlier run left under {tmp}, the ways out the refusal names)
CASES = [
    ("bench --out {tmp}/r", "r/bench.csv", ("--force",)),
    ("bench speed --out {tmp}/r", "r/speed.csv", ("--force",)),
    ("bench video --out {tmp}/r", "r/bench_video.csv", ("--force",)),
    ("bench long --out {tmp}/r", "r/records.jsonl", ("--resume", "--force")),
    ("bench followup --out {tmp}/r", "r/followup.csv", ("--force",)),
    ("bench tower-queries --out {tmp}/r", "r/queries.csv", ("--force",)),
    ("bench footprint --out {tmp}/r", "r/footprint.csv", ("--force",)),
    ("bench kernels --device cpu --out {tmp}/r", "r/bench_kernels_cpu.csv", ("--force",)),
    ("bench serving --out {tmp}/r", "r/serving.csv", ("--force",)),
    ("bench train --steps 1 --workdir {tmp}/w", "w/ckpt.pt", ("--resume", "--force")),
    ("bench train --steps 1 --workdir {tmp}/w --out {tmp}/m", "m/config.json", ("--resume", "--force")),
    ("bench train-dense compact {tmp}/src.pt {tmp}/dst.pt", "dst.pt", ("--force",)),
    ("calibrate --out {tmp}/c.json", "c.json", ("--force",)),
    ("calibrate --out {tmp}/c.json", "c.png", ("--force",)),
    ("tune --out {tmp}/t.json", "t.json", ("--force",)),
    ("bench long-debias {cal} --out {tmp}/trend.md", "trend.md", ("--force",)),
    ("bench long-debias {cal} --curve {tmp}/curves", "curves/calibration-curve.json", ("--force",)),
    ("bench speed-report {tmp}/r --merge {speed}", "r/speed.csv", ("--force",)),
    ("sample --image {tmp}/photo.png", "photo.png", ("--force",)),
    ("sample --video {tmp}/clip.mp4", "clip.mp4", ("--force",)),
]


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """An empty working folder; a model load or a vLLM start fails the test (refusals come first)."""
    import vtprune.models.loading

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(vtprune.models.loading, "load", _no_loading)
    monkeypatch.setenv("VTPRUNE_VLLM_PYTHON", "/bin/false")
    (tmp_path / "src.pt").write_bytes(b"a checkpoint")
    return tmp_path


def _no_loading(*args, **kwargs):
    raise AssertionError("a model was loaded before the earlier results were protected")


def _argv(line: str, tmp: Path) -> list[str]:
    return [part.format(tmp=tmp, cal=CALIBRATION, speed=SPEED_CSV) for part in line.split(" ")]


@pytest.mark.parametrize("line,earlier,ways", CASES, ids=[f"{line} over {file}" for line, file, _ in CASES])
def test_an_earlier_run_is_never_replaced_without_force(line, earlier, ways, work, cli):
    path = work / earlier
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(EARLIER)
    code, _, err = cli(*_argv(line, work))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert path.name in err and all(way in err for way in ways), err
    assert path.read_bytes() == EARLIER


def test_sample_replaces_only_its_own_files_unless_forced(work, cli):
    photo = work / "my_photo.png"
    photo.write_bytes(EARLIER)
    code, _, err = cli("sample", "--image", str(photo))
    assert code == 2 and "did not write it" in err and photo.read_bytes() == EARLIER
    assert cli("sample", "--image", str(photo), "--force")[0] == 0 and photo.read_bytes() != EARLIER
    first = photo.read_bytes()
    code, out, _ = cli("sample", "--image", str(photo), "--index", "3")  # its own file: rewritten, no --force
    assert code == 0 and "test image 3" in out and photo.read_bytes() != first


def test_sample_rewrites_its_own_clip(work, cli):
    pytest.importorskip("av")
    clip = work / "clip.mp4"
    assert cli("sample", "--video", str(clip))[0] == 0
    assert cli("sample", "--video", str(clip), "--index", "1")[0] == 0  # marked as its own: replaced


def test_speed_report_merges_over_its_folder_only_when_forced_or_merged(work, cli, monkeypatch):
    from vtprune.eval.speed import report

    monkeypatch.setattr(report, "plot", lambda rows, out: [])  # the plots are tested with the speed benchmark
    folder = work / "report"
    folder.mkdir()
    shutil.copy(SPEED_CSV, folder / "speed.csv")
    code, _, err = cli("bench", "speed-report", str(folder), "--merge", str(SPEED_CSV), str(folder / "speed.csv"))
    assert code == 0, err  # the folder's own CSV is one of the merged files: nothing is lost
    rows = (folder / "speed.csv").read_text().splitlines()
    assert len(rows) == 2 * len(SPEED_CSV.read_text().splitlines()) - 1
    assert cli("bench", "speed-report", str(folder), "--merge", str(SPEED_CSV), "--force")[0] == 0
    assert (folder / "speed.csv").read_text() == SPEED_CSV.read_text() and (folder / "speed.md").is_file()


def test_the_ways_out_are_accepted(work):
    """``--resume`` and ``--force`` pass the checks that refuse a plain rerun."""
    import torch
    from vtprune.eval.accuracy.long import parse_args
    from vtprune.eval.accuracy.long_resume import record_options, run_options
    from vtprune.eval.training.options import check_outputs
    from vtprune.eval.training.options import parse_args as train_args

    (work / "r").mkdir()
    (work / "r" / "records.jsonl").write_bytes(EARLIER)
    record_options(work / "r", run_options(parse_args(["--out", str(work / "r"), "--force"])))  # its own run
    for extra in ("--resume", "--force"):
        assert parse_args(["--out", str(work / "r"), extra]).out == str(work / "r")
    (work / "w").mkdir()
    torch.save({"step": 1}, work / "w" / "ckpt.pt")  # a whole checkpoint (a damaged one is refused)
    for extra in ("--resume", "--force"):
        check_outputs(train_args(["--steps", "1", extra]), work / "w", work / "w" / "export")


def test_long_debias_writes_over_its_out_with_force(work, cli):
    out = work / "trend.md"
    out.write_bytes(EARLIER)
    code, _, err = cli("bench", "long-debias", str(CALIBRATION), "--out", str(out), "--force")
    assert code == 0, err
    assert out.read_text().startswith("| model |")


def test_train_resume_without_a_checkpoint_never_starts_again_over_out(work, cli):
    """``--resume`` with no ckpt.pt in --workdir (a typo, or the default) is refused before any work, naming
    where it looked; a fresh run still refuses the exported model in --out."""
    model = work / "m" / "config.json"
    model.parent.mkdir()
    model.write_bytes(EARLIER)
    code, _, err = cli("bench", "train", "--steps", "1", "--workdir", str(work / "typo"), "--out", str(work / "m"),
                       "--resume")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(work / "typo" / "ckpt.pt") in err and "leave out --resume" in err and model.read_bytes() == EARLIER
    code, _, err = cli("bench", "train", "--steps", "1", "--workdir", str(work / "w"), "--out", str(work / "m"))
    assert code == 2 and "config.json" in err and model.read_bytes() == EARLIER


def test_train_refuses_resume_with_force_and_a_truncated_checkpoint(work, cli):
    import torch

    (work / "w").mkdir()
    whole = work / "whole.pt"
    torch.save({"step": 3, "weights": torch.ones(4096)}, whole)
    (work / "w" / "ckpt.pt").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # cut mid-write
    code, _, err = cli("bench", "train", "--steps", "1", "--workdir", str(work / "w"), "--resume", "--force")
    assert code == 2 and "not both" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli("bench", "train", "--steps", "1", "--workdir", str(work / "w"), "--resume")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "ckpt.pt is not a complete checkpoint" in err and "--force" in err, err
    from vtprune.eval.training.options import check_checkpoint

    check_checkpoint(whole, "--resume-from")  # a whole one passes
