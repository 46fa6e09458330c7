"""The options of ``vtprune bench train``, checked before any work (one ``error:`` line, exit status 2).

Counts and sizes must be positive, rates and weights finite, checkpoint paths must exist. The workdir and the
export folder of an earlier run are not replaced: a ``ckpt.pt`` in ``--workdir`` is continued with
``--resume`` (or replaced with ``--force``), an exported model in ``--out`` is replaced only by a resumed run
or with ``--force`` (:func:`check_outputs`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vtprune.cli.checks import OneLineParser, int_range, number_range
from vtprune.errors import UserError

POSITIVE = number_range(0.0, above=True)
WEIGHT = number_range(0.0)


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The parsed options of a training run (``argv`` None: the command line)."""
    p = OneLineParser(prog="vtprune bench train", description=description,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["llava", "qwen2_vl"], default="llava")
    p.add_argument("--task", choices=["shapes", "dense"], default="shapes",
                   help="task version: shapes (112 px, 16 tokens) or dense (224 px, 64 tokens, LLaVA only)")
    p.add_argument("--out", type=Path, default=None,
                   help="export folder (default: <workdir>/export; vtprune/models/<name> with --force replaces a "
                        "shipped model)")
    p.add_argument("--workdir", type=Path, default=None, help="checkpoints/logs (default: .train/<arch>)")
    p.add_argument("--force", action="store_true",
                   help="start again over the checkpoint in --workdir and the model in --out an earlier run left")
    p.add_argument("--minutes", type=POSITIVE, default=None, help="wall-clock training budget (> 0)")
    p.add_argument("--steps", type=int_range(1), default=None, help="step budget, >= 1 (deterministic schedule)")
    p.add_argument("--image-size", type=int_range(28, 4096), default=None,
                   help="training image size in px (112; dense: 224)")
    p.add_argument("--patch-size", type=int_range(1, 1024), default=28,
                   help="LLaVA CLIP patch in px (28: one token per object, as Qwen's merged tokens; 14: fragments)")
    p.add_argument("--vision-width", type=int_range(1), default=128)
    p.add_argument("--text-width", type=int_range(1), default=192)
    p.add_argument("--layers", type=int_range(1), default=4, help="layers of the vision tower and of the LM (dense)")
    p.add_argument("--curriculum-steps", type=int_range(0), default=1500,
                   help="dense: scene difficulty ramps 0 -> 1 over these steps (0: full difficulty from the start)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="dense: start from an exported tiny LLaVA's weights (tiny_dense.warm_start), e.g. the 16-token one")
    p.add_argument("--batch", type=int_range(1, 4096), default=32)
    p.add_argument("--lr", type=POSITIVE, default=1e-3)
    p.add_argument("--warmup", type=int_range(0), default=150)
    p.add_argument("--aux-weight", type=WEIGHT, default=1.0)
    p.add_argument("--digit-readout", type=WEIGHT, default=0.0,
                   help="dense: weight of the loss that makes the LM output at digit tokens name the digit")
    p.add_argument("--read-weight", type=WEIGHT, default=1.0,
                   help="dense: loss weight of number answers (tiny_dense.upweight_long_answers)")
    p.add_argument("--aux-balanced", action="store_true",
                   help="dense: each aux head weighs its labelled patches as much as the background ones")
    p.add_argument("--video-clips", type=int_range(0), default=None,
                   help="video clips per step, each question asked as letter and open-ended "
                        "(default 4 for qwen2_vl, 0 for llava)")
    p.add_argument("--val-clips", type=int_range(1), default=30)
    p.add_argument("--seed", type=int_range(0), default=0)
    p.add_argument("--threads", type=int_range(1, 1024), default=1)
    p.add_argument("--log-every", type=int_range(1), default=25)
    p.add_argument("--export-every", type=POSITIVE, default=5.0, help="minutes between eval+export")
    p.add_argument("--val-images", type=int_range(1), default=60)
    p.add_argument("--test-images", type=int_range(1), default=200)
    p.add_argument("--test-clips", type=int_range(1), default=100, help="test video clips (with --video-clips)")
    p.add_argument("--resume", action="store_true", help="continue from <workdir>/ckpt.pt")
    p.add_argument("--resume-from", type=Path, default=None,
                   help="continue from this checkpoint file (e.g. the committed compact one) when the workdir has none")
    p.add_argument("--finish", action="store_true",
                   help="with --resume: train no further; test the best checkpoint and export it as finished")
    p.add_argument("--leg-minutes", type=POSITIVE, default=None,
                   help="stop this process after so many training minutes, checkpoint saved, no test (resume later)")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)  # the options, for the model card's command line
    if a.image_size is None:
        a.image_size = 224 if a.task == "dense" else 112
    if a.task == "dense" and a.arch != "llava":
        p.error("--task dense trains the LLaVA architecture (--arch llava)")
    if a.minutes is None and a.steps is None:
        p.error("give --minutes and/or --steps")
    if a.finish and not (a.resume or a.resume_from):
        p.error("--finish tests a checkpoint: give --resume (or --resume-from FILE)")
    if a.video_clips is None:
        a.video_clips = 4 if a.arch == "qwen2_vl" else 0
    if a.video_clips and a.arch == "llava":
        p.error("--video-clips needs --arch qwen2_vl (the LLaVA model is single-image)")
    if a.resume_from is not None and not a.resume_from.is_file():
        p.error(f"--resume-from {str(a.resume_from)!r}: no such checkpoint file")
    if a.init_from is not None and not (a.init_from / "config.json").is_file():
        p.error(f"--init-from {str(a.init_from)!r}: not an exported model folder (no config.json in it)")
    return a


def check_outputs(args: argparse.Namespace, workdir: Path, out: Path) -> None:
    """Refuse (:class:`UserError`) to start a fresh run over an earlier run's checkpoint or exported model."""
    from vtprune.cli.checks import check_output_dir
    from vtprune.cli.outputs import check_new_results

    check_output_dir(workdir, "--workdir")
    check_output_dir(out, "--out")
    if args.resume and args.force:
        raise UserError("give --resume (continue the checkpoint in --workdir) or --force (start again over it), "
                        "not both.")
    checkpoint = resumed_checkpoint(args, workdir)
    if checkpoint is None:
        check_new_results(workdir, ("ckpt.pt",), args.force, "--workdir", resume=True)
        check_new_results(out, ("config.json", "*.safetensors"), args.force, "--out", resume=True)
    else:
        check_checkpoint(checkpoint, "--resume-from" if checkpoint == args.resume_from else "--resume")


def resumed_checkpoint(args: argparse.Namespace, workdir: Path) -> Path | None:
    """The checkpoint the run continues (``<workdir>/ckpt.pt`` first, then ``--resume-from``), None for a fresh run;
    ``--resume`` with neither is refused, so a mistyped ``--workdir`` never starts again over ``--out``."""
    if not (args.resume or args.resume_from is not None):
        return None
    if (workdir / "ckpt.pt").is_file():
        return workdir / "ckpt.pt"
    if args.resume_from is not None:
        return args.resume_from
    raise UserError(f"--resume: no checkpoint {workdir / 'ckpt.pt'} to continue; give the --workdir of the run to "
                    "continue (or --resume-from FILE), or leave out --resume to start a fresh run.")


def check_checkpoint(path: Path, flag: str) -> None:
    """Refuse a checkpoint file that is not a whole ``torch.save`` archive (e.g. cut by a full disk or a kill)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile) as error:
        damaged = str(error)
    if damaged is not None:
        raise UserError(f"{flag}: {path} is not a complete checkpoint (truncated or damaged: {damaged}); resume from "
                        "an intact one with --resume-from FILE, or start again with --force.")
