"""``vtprune sample --image FILE.png | --video FILE.mp4``: write a vtprune-shapes test input and its questions.

The embedded models answer only the vtprune-shapes task; this writes an image or a clip they can answer
about and prints the questions (with the generator's answers) to ask with ``vtprune run``. No torch here.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from vtprune.cli.checks import check_output_file, int_range
from vtprune.errors import UserError, install_extra

MAX_INDEX = 9_999
FPS = 8


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sample", help="write a vtprune-shapes test image or clip and its questions")
    parser.add_argument("--image", default=None, metavar="PNG", help="write a test image here (PNG, 112 px)")
    parser.add_argument("--video", default=None, metavar="MP4",
                        help="write a test clip here (MP4, 16-32 frames at 8 fps; needs PyAV or OpenCV)")
    parser.add_argument("--index", type=int_range(0, MAX_INDEX), default=0,
                        help=f"which sample of the test split, 0..{MAX_INDEX}")
    parser.set_defaults(func=command_sample)


def command_sample(args: argparse.Namespace) -> int:
    if args.image is None and args.video is None:
        raise UserError("give --image FILE.png and/or --video FILE.mp4 (where to write the sample).")
    image = check_output_file(args.image, "--image") if args.image else None
    video = check_output_file(args.video, "--video") if args.video else None
    if video is not None and video.suffix.lower() not in (".mp4", ".mkv", ".mov", ".avi"):
        raise UserError(f"--video {args.video!r}: give a video file name such as clip.mp4.")
    if image is not None:
        _write_image(image, args.index)
    if video is not None:
        _write_video(video, args.index)
    return 0


def _write_image(path: Path, index: int) -> None:
    from vtprune.shapes.task import make_split

    sample = make_split("test", 1, offset=index)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    sample.image.save(path, format="PNG")
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
