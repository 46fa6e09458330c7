"""``vtprune sample --image FILE.png | --video FILE.mp4``: write a vtprune-shapes test input and its questions.

The embedded models answer only the vtprune-shapes task; this writes an image or a clip they can answer
about and prints the questions (with the generator's answers) to ask with ``vtprune run``. A file that is
already there is replaced only when this command wrote it (its mark: the PNG's ``Software`` text, the clip's
``comment`` tag) or with ``--force``: ``--image`` is an input of ``vtprune run``, so a photo named here by
mistake stays as it is. No torch here.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from vtprune.cli.checks import check_output_file, int_range
from vtprune.errors import UserError, install_extra

MAX_INDEX = 9_999
FPS = 8
MARK = "vtprune sample"  # the PNG's Software text and the clip's comment tag: a file this command wrote
VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sample", help="write a vtprune-shapes test image or clip and its questions")
    parser.add_argument("--image", default=None, metavar="PNG", help="write a test image here (PNG, 112 px)")
    parser.add_argument("--video", default=None, metavar="MP4",
                        help="write a test clip here (MP4, 16-32 frames at 8 fps; needs PyAV or OpenCV)")
    parser.add_argument("--index", type=int_range(0, MAX_INDEX), default=0,
                        help=f"which sample of the test split, 0..{MAX_INDEX}")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing file that vtprune sample did not write (default: refuse)")
    parser.set_defaults(func=command_sample)


def command_sample(args: argparse.Namespace) -> int:
    if args.image is None and args.video is None:
        raise UserError("give --image FILE.png and/or --video FILE.mp4 (where to write the sample).")
    image = _target(args.image, "--image", (".png",), args.force) if args.image is not None else None
    video = _target(args.video, "--video", VIDEO_SUFFIXES, args.force) if args.video is not None else None
    if image is not None:
        _write_image(image, args.index)
    if video is not None:
        _write_video(video, args.index)
    return 0


def _target(path: str, flag: str, suffixes: tuple[str, ...], force: bool) -> Path:
    """The checked output path of ``flag``: its suffix, a writable place, and no file this command did not write."""
    example = "shapes.png" if flag == "--image" else "clip.mp4"
    if not path.strip():
        raise UserError(f"{flag} is empty; give a file name such as {flag} {example}.")
    target = check_output_file(path, flag)
    if target.exists() and not force and not written_here(target):
        raise UserError(f"{flag} {path!r} already exists and vtprune sample did not write it; give a new file name, "
                        "or --force to replace it.")
    if target.suffix.lower() not in suffixes:
        raise UserError(f"{flag} {path!r}: vtprune sample writes {' / '.join(suffixes)}; give a file name such as "
                        f"{example}.")
    return target


def written_here(path: Path) -> bool:
    """Did ``vtprune sample`` write ``path`` (its mark in the PNG text or the clip's tags)? False if unreadable."""
    try:
        if path.suffix.lower() == ".png":
            from PIL import Image

            with Image.open(path) as image:
                return image.format == "PNG" and getattr(image, "text", {}).get("Software", "").startswith(MARK)
        import av

        with av.open(str(path)) as container:
            return str(container.metadata.get("comment", "")).startswith(MARK)
    except Exception:  # not an image / clip, unreadable, no PyAV: not ours
        return False


def _write_image(path: Path, index: int) -> None:
    from PIL.PngImagePlugin import PngInfo

    from vtprune.shapes.task import make_split

    sample = make_split("test", 1, offset=index)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PngInfo()
    info.add_text("Software", f"{MARK} --index {index}")
    sample.image.save(path, format="PNG", pnginfo=info)
    print(f"wrote {path}: vtprune-shapes test image {index} ({sample.image.width}x{sample.image.height} px). "
          "Questions the embedded models answer about it (generator's answer on the right):")
    width = max(len(q.text) for q in sample.questions)
    for question in sample.questions:
        note = "   (no embedded model has learned to read numbers)" if question.qtype == "read" else ""
        print(f"  {question.text:<{width}}  {question.answer}{note}")
    first = sample.questions[0].text
    print(f"try: vtprune run --image {shlex.quote(str(path))} --question {shlex.quote(first)}")


def _write_video(path: Path, index: int) -> None:
    from vtprune.shapes.task import SPLIT_SEEDS
    from vtprune.shapes.video import generate_video_sample, open_form

    clip = generate_video_sample(SPLIT_SEEDS["test"], index)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = write_clip(path, clip.frames, FPS)
    print(f"wrote {path}: vtprune-shapes test clip {index}, {len(clip.frames)} frames at {FPS} fps ({writer}). "
          "Questions (the object is visible only in the frames listed):")
    for question in clip.questions:
        text, answer = open_form(question)
        print(f"  {text}  {answer}   (frames {question.frames[0]}-{question.frames[-1]}; multiple choice: "
              f"{question.text!r}, answer {question.answer})")
    first = open_form(clip.questions[0])[0]
    print(f"try: vtprune run --video {shlex.quote(str(path))} --question {shlex.quote(first)} --gridprobe 4")


def write_clip(path: Path, frames: list, fps: int) -> str:
    """Write RGB PIL frames as H.264 (PyAV) or MPEG-4 (OpenCV); the writer used. UserError without either."""
    import numpy as np

    arrays = [np.asarray(frame.convert("RGB")) for frame in frames]
    try:
        import av
    except ImportError:
        av = None
    if av is not None:
        with av.open(str(path), "w") as container:
            container.metadata["comment"] = MARK
            stream = container.add_stream("libx264", rate=fps)
            stream.height, stream.width = arrays[0].shape[:2]
            stream.pix_fmt = "yuv420p"
            for array in arrays:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
            container.mux(stream.encode())
        return "PyAV, H.264"
    try:
        import cv2
    except ImportError:
        raise UserError(f"writing a clip needs PyAV or OpenCV: {install_extra('video')}.") from None
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, arrays[0].shape[1::-1])
    for array in arrays:
        writer.write(cv2.cvtColor(array, cv2.COLOR_RGB2BGR))
    writer.release()
    return "OpenCV, MPEG-4"
