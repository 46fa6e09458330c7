"""The model side of the Gradio demo (no Gradio here): unpruned vs pruned runs, scores, costs, examples.

``demos/app.py`` (the UI, launched by ``vtprune demo``) calls :class:`DemoRunner`; ``demos/overlay.py`` draws
the pictures from what it returns. The importance scores are the method's own: the runner wraps ``score``
(and ``refine``, to see merged tokens) of the method *instance* of its handle, so nothing global changes.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

import vtprune
from vtprune.demo.uploads import IMAGE_SUFFIXES as IMAGE_SUFFIXES
from vtprune.demo.uploads import MAX_UPLOAD_MB as MAX_UPLOAD_MB
from vtprune.demo.uploads import VIDEO_SUFFIXES as VIDEO_SUFFIXES
from vtprune.demo.uploads import UploadError
from vtprune.demo.uploads import check_upload as check_upload
from vtprune.demo.uploads import load_image as load_image
from vtprune.errors import install_extra
from vtprune.flops import LMShape, kv_cache_bytes, prefill_flops, tokens_per_layer
from vtprune.models.notes import empty_answer_note, input_notes
from vtprune.models.pipeline import answer_questions, build_inputs, check_prompt_length

EXAMPLES_DIR = Path(tempfile.gettempdir()) / "vtprune-demo" / "examples"
EXAMPLE_IMAGES = 4


class VideoUnavailable(RuntimeError):
    """Video input needs GridProbe and a video reader, which this installation lacks."""


@dataclass
class RunResult:
    """One side of the comparison (the unpruned model or the pruned one)."""

    answer: str
    visual_tokens: int
    stage_layers: list[int]
    kept: list[int]
    kept_indices: list[int]
    prefill_ms: float
    flops: float
    kv_bytes: int
    merged: list[int] = field(default_factory=list)
    recycled: list[int] = field(default_factory=list)

    @property
    def final_tokens(self) -> int:
        return self.kept[-1] if self.kept else self.visual_tokens


@dataclass
class Comparison:
    """Unpruned vs pruned answers for one image and question, with what the pictures need.

    ``grid`` is the image's token grid ``(h, w)`` (None when the model's layout is not one plain grid);
    ``scores`` the method's per-token scores (grid order, ``NaN`` = not scored) for its first stage (before
    decoder layer ``stage_layer``), computed from the input of layer ``score_layer`` (``-1``: pre-LLM).
    """

    image: Image.Image
    grid: tuple[int, int] | None
    full: RunResult
    pruned: RunResult
    scores: np.ndarray | None = None
    stage_layer: int | None = None
    score_layer: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.full.prefill_ms / self.pruned.prefill_ms if self.pruned.prefill_ms > 0 else float("nan")

    @property
    def flops_ratio(self) -> float:
        return self.full.flops / self.pruned.flops if self.pruned.flops > 0 else float("nan")


@dataclass
class VideoComparison:
    """The unpruned all-candidates answer (``full``) and the GridProbe one (``probed``) with its frames."""

    full: Any
    probed: Any
    frames: list[Image.Image]

    @property
    def spent_ms(self) -> float:
        return self.probed.probe_ms + self.probed.answer_ms

    @property
    def speedup(self) -> float:
        return self.full.answer_ms / self.spent_ms if self.spent_ms > 0 else float("nan")


class ScoreRecorder:
    """Observes a handle's stages (sample 0): scores by grid ordinal, where they were scored, merged tokens."""

    def __init__(self, handle: Any) -> None:
        self.scores: dict[int, np.ndarray] = {}
        self.scored_at: dict[int, int] = {}
        self.merged: dict[int, list[int]] = {}
        handle.observe(self.record)

    def record(self, record: Any) -> None:
        layer = record.stage.layer
        self.scores[layer] = _by_ordinal(record, record.scores)
        self.scored_at[layer] = record.score_layer
        if record.merged is not None:
            self.merged[layer] = sorted(record.ordinal[0][record.merged[0]].tolist())


def _by_ordinal(record: Any, values: torch.Tensor) -> np.ndarray:
    """Scores of sample 0 in grid order, ``NaN`` for tokens already pruned."""
    out = np.full(record.visual_tokens[0], np.nan)
    alive = record.visual[0]
    ordinals = record.ordinal[0][alive].cpu().numpy()
    out[ordinals] = values[0][alive].float().cpu().numpy()
    return out


@lru_cache(maxsize=1)
def _example_samples() -> tuple:
    from vtprune.shapes.task import make_split

    return tuple(make_split("test", EXAMPLE_IMAGES))


def _oracle_evidence(image: Image.Image, question: str, grid: tuple[int, int] | None) -> list[float]:
    """Evidence weights of an example image's own question (the ``oracle`` method needs the answer's boxes)."""
    from vtprune.shapes.task import evidence_mask

    pixels = np.asarray(image.convert("RGB"))
    for sample in _example_samples() if grid else ():
        same = sample.image.size == image.size and np.array_equal(np.asarray(sample.image.convert("RGB")), pixels)
        for asked in sample.questions if same else ():
            if asked.text.strip().lower() == question.strip().lower():
                return evidence_mask(asked.boxes, image.size, *grid).astype(float).tolist()
    raise ValueError("'oracle' keeps the tokens that hold the answer, which are known only for the example "
                     "images with one of their own questions (e.g. the examples below).")


def model_view(image: Image.Image, processor: Any) -> Image.Image:
    """The image as the model sees it: center-cropped and resized like a CLIP processor, else unchanged."""
    image = image.convert("RGB")
    config = getattr(processor, "image_processor", None)
    crop = getattr(config, "crop_size", None)
    if config is None or not getattr(config, "do_center_crop", False) or not crop:
        return image
    size = (int(crop), int(crop)) if isinstance(crop, int | float) else (int(crop["width"]), int(crop["height"]))
    return ImageOps.fit(image, size, method=Image.Resampling.BICUBIC)


class DemoRunner:
    """Holds one loaded model and answers with and without pruning (one call at a time, under a lock)."""

    def __init__(self, model_spec: str | None = None, device: str | None = None, timing_repeats: int = 3,
                 max_new_tokens: int = 8) -> None:
        from vtprune.models.loading import load, model_label

        self.model, self.processor = load(model_spec, device=device)
        self.label = model_label(model_spec)
        self.embedded = self.label.startswith("embedded")
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.shape = LMShape.from_config(self.model.config)
        self.timing_repeats, self.max_new_tokens = timing_repeats, max_new_tokens
        self.lock = threading.Lock()

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    def compare(self, image: Image.Image, question: str, method: str, keep: float,
                debias: bool = False) -> Comparison:
        """Answer ``question`` unpruned and pruned by ``method`` at ``keep``; ``ValueError`` on bad settings.

        ``notes`` are the CLI's (``vtprune run``): words or a question form the model cannot read, a centre
        crop, an empty answer.
        """
        notes = input_notes(self.processor, question, self.embedded, image.size)
        image = model_view(image, self.processor)
        with self.lock:
            text_tokens, visual, grid = self._layout(image, question)
            full = self._run(image, question, None, text_tokens)
            handle = vtprune.wrap(self.model, method, keep=keep, **({"debias": True} if debias else {}))
            try:
                if method == "oracle":
                    handle.set_evidence([_oracle_evidence(image, question, grid)])
                recorder = ScoreRecorder(handle)
                pruned = self._run(image, question, handle, text_tokens)
            finally:
                handle.remove()
        pruned.recycled = sorted({i for ids in recorder.merged.values() for i in ids})
        pruned.merged = sorted(set(pruned.recycled) & set(pruned.kept_indices))
        empty = [empty_answer_note(full.answer, self.max_new_tokens, "the unpruned model"),
                 empty_answer_note(pruned.answer, self.max_new_tokens, "the pruned model")]
        result = Comparison(image=image, grid=grid, full=full, pruned=pruned,
                            notes=notes + [note for note in empty if note])
        if recorder.scores:
            stage = min(recorder.scores)
            result.scores, result.stage_layer = recorder.scores[stage], stage
            result.score_layer = recorder.scored_at[stage]
        return result

    def gridprobe(self, path: str, question: str, k: int, method: str, keep: float,
                  debias: bool = False) -> VideoComparison:
        """All ``K^2`` uniform frames unpruned vs GridProbe-selected frames pruned by ``method`` at ``keep``.

        Raises :class:`VideoUnavailable` when GridProbe or a video reader is not installed.
        """
        try:
            from vtprune.gridprobe.run import run_gridprobe
            from vtprune.media.video import load_video
        except ImportError as error:
            raise VideoUnavailable(f"video support not installed ({error}); {install_extra('video')}.") from error
        self._check_question(question)
        try:
            clip = load_video(path, num_frames=k * k)
        except (ValueError, FileNotFoundError) as error:  # not decodable, over the limits: a bad file, not a method
            raise UploadError(f"{Path(path).name} is not a usable video: {error}") from error
        options = {"debias": True} if debias else {}
        token_method = None if method == "none" else method
        with self.lock:
            full = run_gridprobe(self.model, self.processor, clip, question, k=None)
            probed = run_gridprobe(self.model, self.processor, clip, question, k=k, token_method=token_method,
                                   keep=keep, wrap_options=options)
        positions = [clip.indices.index(i) for i in probed.frames_selected]
        return VideoComparison(full=full, probed=probed, frames=[clip.frames[i] for i in positions])

    def _layout(self, image: Image.Image, question: str) -> tuple[int, int, tuple[int, int] | None]:
        """Text tokens, visual tokens and the token grid of the prompt (batch of one)."""
        from vtprune.adapters import get_adapter

        inputs = build_inputs(self.processor, [image], [question], self.model_type)
        check_prompt_length(self.model, inputs["input_ids"], self.max_new_tokens, what="the question's prompt")
        adapter = get_adapter(self.model)
        visual = int(adapter.visual_mask(inputs["input_ids"]).sum())
        segments = adapter.segments(inputs["input_ids"], inputs)[0]
        grid = None
        if len(segments) == 1 and segments[0].t == 1 and segments[0].extra == 0 and segments[0].h > 1:
            grid = (segments[0].h, segments[0].w)
        return int(inputs["input_ids"].shape[1]) - visual, visual, grid

    def _check_question(self, question: str) -> None:
        """Refuse a question that alone (without any frame) would not fit the model's context."""
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is not None:
            ids = tokenizer(question, return_tensors="pt")["input_ids"]
            check_prompt_length(self.model, ids, self.max_new_tokens, what="the question")

    def _run(self, image: Image.Image, question: str, handle: Any, text_tokens: int) -> RunResult:
        answer = answer_questions(self.model, self.processor, [image], [question], handle,
                                  self.max_new_tokens, timing_repeats=self.timing_repeats)[0]
        stages = list(zip(answer.stage_layers, answer.kept_tokens, strict=True))
        per_layer = tokens_per_layer(self.shape, text_tokens, answer.visual_tokens, stages)
        element = next(self.model.parameters()).element_size()
        kept_indices = answer.kept_indices[-1] if answer.kept_indices else list(range(answer.visual_tokens))
        return RunResult(answer=answer.answer, visual_tokens=answer.visual_tokens,
                         stage_layers=answer.stage_layers, kept=answer.kept_tokens, kept_indices=kept_indices,
                         prefill_ms=answer.prefill_ms, flops=prefill_flops(self.shape, per_layer),
                         kv_bytes=kv_cache_bytes(self.shape, per_layer, element))


def write_examples(folder: Path = EXAMPLES_DIR, images: int = EXAMPLE_IMAGES) -> list[tuple[str, str]]:
    """Generated vtprune-shapes test inputs as ``(path, question)``: PNG images, then one MP4 clip if possible.

    Files are rewritten at every start (atomically), so they always match the current generator.
    """
    from vtprune.shapes.task import make_split

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for number, sample in enumerate(make_split("test", images)):
        path = folder / f"shapes_test_{sample.index:03d}.png"
        _replace(path, lambda target, image=sample.image: image.save(target, format="PNG"))
        rows.append((str(path), sample.questions[number % len(sample.questions)].text))
    clip = _write_example_video(folder)
    if clip is not None:
        rows.append(clip)
    return rows


def _replace(path: Path, write: Any) -> None:
    """``write(temporary path)`` next to ``path``, then move it over ``path`` (readers never see half a file)."""
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=path.suffix, delete=False) as handle:
        temporary = Path(handle.name)
    try:
        write(temporary)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)


def _write_example_video(folder: Path, fps: float = 8.0) -> tuple[str, str] | None:
    """One vtprune-shapes test clip as MP4 (OpenCV, ``mp4v``); None when OpenCV cannot write it."""
    try:
        import cv2

        from vtprune.shapes.video import make_video_split
    except ImportError:
        return None
    sample = make_video_split("test", 1)[0]

    def write(target: Path) -> None:
        writer = cv2.VideoWriter(str(target), cv2.VideoWriter_fourcc(*"mp4v"), fps, sample.frames[0].size)
        for frame in sample.frames:
            writer.write(cv2.cvtColor(np.asarray(frame.convert("RGB")), cv2.COLOR_RGB2BGR))
        writer.release()

    path = folder / "shapes_test_clip_000.mp4"
    _replace(path, write)
    return (str(path), sample.questions[0].text) if path.stat().st_size else None


def model_summary(runner: DemoRunner) -> str:
    """Markdown: which model is loaded, what it can answer, and how to switch to a real checkpoint."""
    tokenizer = getattr(runner.processor, "tokenizer", runner.processor)
    kinds = {"llava": "LLaVA", "llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision", "qwen2_vl": "Qwen2-VL",
             "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}
    kind = kinds.get(runner.model_type, runner.model_type)
    if not runner.embedded:
        return (f"Model **{runner.label}** ({runner.parameters / 1e9:.1f} B parameters, {kind}): a real checkpoint; "
                "ask about any image. Speed figures are measured on this machine.")
    from vtprune.models.vocabulary import example_questions

    sample = _example_samples()[0]
    _, visual, _ = runner._layout(sample.image, sample.questions[0].text)
    asks = ", ".join(f"*{q}*" for q in example_questions()[:4])
    return (f"Model **{runner.label}**: a {runner.parameters / 1e6:.1f} M-parameter {kind} shipped with vtprune and "
            f"trained only on the synthetic *vtprune-shapes* task: one-word answers about coloured shapes on a grey "
            f"texture ({visual} visual tokens per image, a vocabulary of {len(tokenizer)} words), to questions such as "
            f"{asks}. Click a sample image below: it fills in the image and one of its questions. A photo gets a "
            "word from that vocabulary or nothing, which says nothing about the photo (the notes say so). For real "
            "images, start the demo on a real checkpoint, e.g. "
            "[llava-hf/llava-1.5-7b-hf](https://huggingface.co/llava-hf/llava-1.5-7b-hf): "
            "`vtprune demo --model llava-hf/llava-1.5-7b-hf --device cuda` (about 15 GB of GPU memory).")


def speed_caption(runner: DemoRunner, visual_tokens: int) -> str:
    """What the time and FLOP figures mean for the loaded model (a tiny embedded one: not much)."""
    if not runner.embedded:
        return ("Prefill: median of repeated runs on this machine (vision tower + LM prompt forward). FLOPs: the "
                "language model's prefill, from the kept tokens per layer.")
    runs = f"{runner.timing_repeats} runs" if runner.timing_repeats > 1 else "1 run"
    return (f"Prefill: median of {runs} on this machine. On a {runner.parameters / 1e6:.1f} "
            f"M-parameter model with {visual_tokens} visual tokens a prefill takes milliseconds and fixed costs "
            "(vision tower, scoring, hooks) dominate, so the time ratio is noise and often below 1×. The FLOPs and "
            "KV-cache ratios are what carry over to a 7B model with 576 visual tokens per image, where the "
            "measured prefill speedup follows the FLOP ratio closely (vtprune's speed benchmark, "
            "docs/results/speed-proxy).")
