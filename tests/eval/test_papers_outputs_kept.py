"""Nothing lost in ``vtprune bench reproduce`` and ``vtprune bench lmms-prepare``: what an earlier call left in the
folder the user names is continued or refused (one line, before any work, every byte kept), and replaced only
with ``--force``. lmms-eval is replaced by a fake that writes a results file, so no model runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vtprune.eval.lmms_plugin import prepare
from vtprune.eval.papers import reproduce
from vtprune.eval.papers import table as reproduce_table
from vtprune.eval.papers.runs import RUN_FILE, TIMING_FILE, check_runs, recorded

from vtprune.errors import UserError

QUICK = ["bench", "reproduce", "--models", "llava-1.5-7b", "--methods", "dart"]  # none + the dart rows: 4 runs


@pytest.fixture
def lmms(monkeypatch) -> list[Path]:
    """The run folders lmms-eval was started in, in order (a fake: one results file per run)."""
    started: list[Path] = []

    def fake_run(argv: list[str], out: Path, launcher: list[str]) -> dict:
        started.append(out)
        (out / "org__model").mkdir(parents=True, exist_ok=True)
        results = {"results": {}, "config": {"limit": argv[argv.index("--limit") + 1] if "--limit" in argv else None}}
        (out / "org__model" / f"{len(started):04d}_results.json").write_text(json.dumps(results))
        return results

    monkeypatch.setattr(reproduce, "run_subprocess", fake_run)
    monkeypatch.setattr(reproduce, "run_in_process", lambda *a: pytest.fail("a dry run started"))
    monkeypatch.setattr(reproduce, "write_paper_tasks", lambda folder: Path(folder))
    monkeypatch.setattr(reproduce_table, "table", lambda *a: [])
    monkeypatch.setattr(reproduce_table, "conditions", lambda *a: {})
    return started


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_rerun_with_the_same_options_continues_and_other_options_are_refused(tmp_path, lmms, cli):
    out = tmp_path / "r"
    assert cli(*QUICK, "--limit", "200", "--out", str(out))[0] == 0
    runs = list(lmms)
    assert len(runs) == 4 and all(recorded(run)["--limit"] == "200" for run in runs)
    assert cli(*QUICK, "--limit", "200", "--out", str(out))[0] == 0 and lmms == runs  # all four reused
    before = _tree(out)
    code, _, err = cli(*QUICK, "--out", str(out))  # the full benchmarks: not the same runs
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "llava-1.5-7b/none-1/wall_s.json" in err and "--limit 200, now unset" in err and "--force" in err, err
    assert lmms == runs and _tree(out) == before
    code, _, err = cli(*QUICK, "--limit", "200", "--launcher", "accelerate launch", "--out", str(out))
    assert code == 2 and "--launcher" in err and _tree(out) == before, err  # the table's timings would mix
    assert cli(*QUICK, "--out", str(out), "--force")[0] == 0 and len(lmms) == 8
    assert all(recorded(run).get("--limit") is None and len(list(run.rglob("*_results.json"))) == 1 for run in runs)


def test_a_cut_run_starts_again_from_an_empty_folder(tmp_path, lmms, cli):
    out = tmp_path / "r"
    assert cli(*QUICK, "--out", str(out))[0] == 0
    cut = lmms[1]
    (cut / TIMING_FILE).unlink()  # lmms-eval wrote its results, the timing never came
    assert cli(*QUICK, "--out", str(out))[0] == 0
    assert lmms[4:] == [cut]  # only the unfinished run ran again
    assert [p.name for p in cut.rglob("*_results.json")] == ["0005_results.json"]  # no older file left to stand in


def test_a_run_whose_options_were_not_recorded_is_refused(tmp_path, lmms, cli):
    out = tmp_path / "r"
    assert cli(*QUICK, "--out", str(out))[0] == 0
    (lmms[0] / RUN_FILE).unlink()  # as a reproduce before run.json left it
    code, _, err = cli(*QUICK, "--out", str(out))
    assert code == 2 and "not recorded in run.json" in err and len(lmms) == 4, err


def test_a_dry_run_refuses_finished_runs_of_either_kind(tmp_path, lmms, cli):
    out = tmp_path / "r"
    assert cli(*QUICK, "--out", str(out))[0] == 0
    code, _, err = cli(*QUICK, "--dry-run", "--out", str(out))
    assert code == 2 and "mode checkpoints, now dry run" in err and "continue" not in err, err
    args = reproduce.build_parser().parse_args(["--dry-run", "--limit", "12", "--out", str(out)])
    args.checkpoints = {}
    planned = reproduce.planned_options(reproduce.plan(reproduce.load_papers(), ["llava-1.5-7b"], ["dart"]), args)
    for name, options in planned.items():  # an earlier dry run with the same options
        (out / "runs" / name / RUN_FILE).write_text(json.dumps({"options": options}))
    with pytest.raises(UserError, match="from an earlier dry run"):
        check_runs(out, planned, force=False, dry_run=True)
    assert check_runs(out, planned, force=True, dry_run=True) == set()


def test_an_out_that_is_a_file_is_refused(tmp_path, lmms, cli):
    (tmp_path / "r").write_text("mine")
    code, _, err = cli(*QUICK, "--out", str(tmp_path / "r"))
    assert code == 2 and "is a file" in err and lmms == [] and (tmp_path / "r").read_text() == "mine"


def test_lmms_prepare_rewrites_its_own_tasks_and_refuses_a_folder_it_did_not_write(tmp_path, cli):
    out = tmp_path / "tasks"
    assert cli("bench", "lmms-prepare", "--out", str(out), "--n", "1")[0] == 0
    docs = out / prepare.IMAGE_TASK / "data" / "docs.jsonl"
    one = len(docs.read_text().splitlines())
    assert cli("bench", "lmms-prepare", "--out", str(out), "--n", "2")[0] == 0  # its own folders: rewritten
    assert len(docs.read_text().splitlines()) > one
    mine = tmp_path / "mine"
    (mine / prepare.CHOICE_TASK).mkdir(parents=True)
    (mine / prepare.CHOICE_TASK / "notes.txt").write_text("the user's")
    code, _, err = cli("bench", "lmms-prepare", "--out", str(mine), "--n", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{prepare.CHOICE_TASK}/" in err and "--force" in err
    assert sorted(p.name for p in mine.iterdir()) == [prepare.CHOICE_TASK]  # nothing written, not even the first task
    assert (mine / prepare.CHOICE_TASK / "notes.txt").read_text() == "the user's"
    assert cli("bench", "lmms-prepare", "--out", str(mine), "--n", "1", "--force")[0] == 0
    assert prepare.written_here(mine / prepare.CHOICE_TASK) and not (mine / prepare.CHOICE_TASK / "notes.txt").exists()


def test_lmms_prepare_checks_the_video_task_only_when_it_writes_it(tmp_path):
    (tmp_path / prepare.VIDEO_TASK).mkdir()
    assert prepare.prepare(tmp_path, n_images=1) == tmp_path.resolve()  # no video asked: the folder is not touched
    assert (tmp_path / prepare.VIDEO_TASK).is_dir() and not any((tmp_path / prepare.VIDEO_TASK).iterdir())
    with pytest.raises(UserError, match=prepare.VIDEO_TASK):
        prepare.prepare(tmp_path, n_images=1, video_clips=1)
