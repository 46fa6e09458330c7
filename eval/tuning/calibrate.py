"""Fit the positional attention trend of attention debiasing (arXiv:2508.17807, spec 2.2 step 5).

For a ``(model, host method, scoring layer)``: run the unpruned model on calibration prompts, record the
host's raw attention score vector over the visual tokens at the scoring layer (through the engine's
scoring hook with ``keep=1``: recomputed from q/k, no eager attention), normalise each vector to mean 1,
drop padded positions, pool the ``(x = i / N0, a)`` pairs and fit ``log a = log mu + sigma x`` by least
squares; the binned mean curve is stored too. :func:`calibrate` returns the JSON-ready dict that
``debias=FILE`` reads (:func:`vtprune.methods.debias.read_calibration`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from PIL import Image
from tqdm.auto import tqdm
from vtprune.adapters import get_adapter

import vtprune
from vtprune.config import Stage
from vtprune.errors import UserError
from vtprune.media.images import MAX_ASPECT, open_image
from vtprune.media.video import frame_inputs
from vtprune.methods import Scorer, resolve
from vtprune.methods.debias import DEFAULT_TAU, FORMAT, binned_curve, fit_exponential
from vtprune.models.pipeline import build_inputs
from vtprune.scoring import ScoreContext

HOST_QUERIES = {"fastv": "last", "pdrop": "last", "transprune": "instruction"}
DEFAULT_QUESTION = "What is in the image?"


def calibration_items(data: str | None, n: int, task: str = "shapes") -> list[tuple[Image.Image, str]]:
    """``n`` (image, question) pairs: the vtprune-shapes ``calib`` split (``task="dense"``: its dense version,
    for ``embedded:llava64``), or a folder of images.

    A folder may hold ``questions.jsonl`` (rows with ``image``, a path relative to the folder, and
    ``question``); otherwise every ``*.png`` / ``*.jpg`` / ``*.jpeg`` is asked ``DEFAULT_QUESTION``.
    """
    if data is None:
        if task == "dense":
            from vtprune.shapes.dense import make_dense_split as make_split
        else:
            from vtprune.shapes.task import make_split

        samples = make_split("calib", n)
        return [(s.image, s.questions[i % len(s.questions)].text) for i, s in enumerate(samples)]
    folder = Path(data)
    if not folder.is_dir():
        raise UserError(f"--data {data!r} is not a folder of images.")
    listing = folder / "questions.jsonl"
    pairs = _listed_pairs(folder, listing) if listing.is_file() else [
        (p, DEFAULT_QUESTION) for p in sorted(folder.iterdir()) if p.suffix.lower() in (".png", ".jpg", ".jpeg")]
    if not pairs:
        raise UserError(f"--data {data!r} holds no images (png / jpg) and no questions.jsonl.")
    return [(open_image(path, max_aspect=MAX_ASPECT), question) for path, question in pairs[:n]]


def _listed_pairs(folder: Path, listing: Path) -> list[tuple[Path, str]]:
    """``(image path, question)`` rows of ``questions.jsonl``; :class:`UserError` naming the line otherwise."""
    pairs = []
    for number, line in enumerate(listing.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{listing} line {number} is not valid JSON ({error.msg}).") from error
        image, question = (row.get("image"), row.get("question", DEFAULT_QUESTION)) if isinstance(row, dict) else (None, None)
        if not isinstance(image, str) or not image or not isinstance(question, str) or not question.strip():
            raise UserError(f"{listing} line {number}: each row needs \"image\" (a path relative to the folder) and "
                            f"an optional non-empty \"question\" string, got {line.strip()[:120]!r}.")
        pairs.append((folder / image, question))
    return pairs


@dataclass(frozen=True)
class Recorder(Scorer):
    """Scores like the host's attention term and records each sample's visual score vector (keep=1)."""

    name: ClassVar[str] = "calibration-recorder"
    requires: ClassVar[frozenset[str]] = frozenset({"attention"})
    host: Scorer = field(default_factory=Scorer)
    query: str = "last"
    records: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    padding: list = field(default_factory=list)

    def score_layer(self, stage: Stage) -> int:
        return self.host.score_layer(stage)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        scores = ctx.attention(self.query)
        if "padding" not in ctx.state:
            ids = ctx.inputs.get("input_ids")
            ctx.state["padding"] = ctx.adapter.padding_fraction(ids, ctx.inputs) if ids is not None else None
            fractions = ctx.state["padding"]
            self.padding.extend(fractions or [torch.zeros(0)] * scores.shape[0])
        rows = self.records.setdefault(ctx.layer_index, [])
        for b in range(scores.shape[0]):
            alive = ctx.ordinal[b] >= 0
            vector = torch.zeros(int(ctx.num_visual[b]))
            vector[ctx.ordinal[b, alive].cpu()] = scores[b, alive].float().cpu()
            rows.append(vector)
        return scores


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def record(model: Any, processor: Any, items: list[tuple[Image.Image, str]], method: str, layers: list[int],
           batch_size: int = 16, progress: bool = True) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """Raw score vectors per scoring layer and the matching padding fractions (``[N0]`` per prompt).

    An item whose image is a list of images (all frames of a clip, several images) is one prompt with one
    image placeholder per image (``vtprune.media.video``'s ``images`` route).

    With a LLaVA processor that pads to square (``do_pad=True``) the original image sizes feed the padding map.
    """
    recorder = Recorder(host=resolve(method), query=HOST_QUERIES[method])
    schedule = ",".join(f"{layer}:1" for layer in layers)
    device = next(model.parameters()).device
    pad_sizes = bool(getattr(getattr(processor, "image_processor", None), "do_pad", False))
    with vtprune.apply(model, recorder, keep=1.0, schedule=schedule) as handle:
        for chunk in tqdm(list(_batches(items, batch_size)), desc="calibrate", disable=not progress):
            images, questions = [im for im, _ in chunk], [q for _, q in chunk]
            if isinstance(images[0], list):  # several images per prompt (all frames of a clip, multi-image)
                inputs = frame_inputs(processor, model.config.model_type, images, questions, "images")
            else:
                inputs = build_inputs(processor, images, questions, model.config.model_type)
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            if pad_sizes and handle.adapter.image_sizes_from_user and not isinstance(images[0], list):
                handle.set_image_sizes([(im.height, im.width) for im, _ in chunk])
            with torch.inference_mode():
                model(**inputs, logits_to_keep=1)
    return recorder.records, recorder.padding


def fit_layer(vectors: list[torch.Tensor], padding: list[torch.Tensor], tau: float, bins: int) -> dict[str, Any]:
    """Fit of one scoring layer from per-prompt score vectors (mean-1 normalised, padded positions dropped)."""
    xs, values = [], []
    for vector, fraction in zip(vectors, padding, strict=True):
        count = vector.numel()
        keep = torch.ones(count, dtype=torch.bool) if fraction.numel() != count else fraction <= tau
        if not bool(keep.any()) or float(vector[keep].mean()) <= 0:
            continue
        xs.append((torch.arange(count, dtype=torch.float64) / count)[keep])
        values.append((vector[keep] / vector[keep].mean()).double())
    x, a = torch.cat(xs), torch.cat(values)
    mu, sigma, r2 = fit_exponential(x, a)
    centres, means, counts = binned_curve(x, a, bins)
    return {"sigma": sigma, "mu": mu, "r2": r2, "n_pairs": int(x.numel()),
            "curve": {"x": centres, "mean": means, "count": counts}}


def default_layers(method: str, num_layers: int) -> list[int]:
    """The host's default stage layers for this depth."""
    return [s.layer for s in resolve(method).schedule(num_layers, 0.25) if s.layer > 0]


def calibrate(model: Any, processor: Any, items: list[tuple[Image.Image, str]], method: str = "fastv",
              layers: list[int] | None = None, batch_size: int = 16, bins: int = 32, tau: float = DEFAULT_TAU,
              model_name: str = "", progress: bool = True) -> dict[str, Any]:
    """The calibration record (JSON-ready) of ``method``'s attention trend on ``items``."""
    if method not in HOST_QUERIES:
        raise ValueError(f"--method {method!r}: calibration covers the attention hosts {', '.join(HOST_QUERIES)}.")
    num_layers = get_adapter(model).num_layers
    layers = layers or default_layers(method, num_layers)
    offset = resolve(method).score_offset
    for layer in layers:
        if not offset <= layer < num_layers or layer < 1:
            raise ValueError(f"--layer {layer} must be in [{max(1, offset)}, {num_layers - 1}] for {method} "
                             "(the pruning layer; scores come from layer K - score_offset).")
    records, padding = record(model, processor, items, method, sorted(set(layers)), batch_size, progress)
    fits = {str(k): fit_layer(v, padding, tau, bins) for k, v in sorted(records.items())}
    return {"format": FORMAT, "version": 1, "model": model_name, "model_type": model.config.model_type,
            "method": method, "query": HOST_QUERIES[method], "stage_layers": sorted(set(layers)),
            "score_layers": sorted(int(k) for k in fits), "layers": fits, "trend": "exp", "tau": tau,
            "x": "ordinal / N0 over the sample's whole visual sequence", "n_samples": len(items),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "vtprune_version": vtprune.__version__}


def plot(result: dict[str, Any], path: str | Path) -> Path | None:
    """PNG of the binned mean attention by position with the fitted curves (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(6.4, 4.0))
    for key, entry in result["layers"].items():
        xs = torch.tensor(entry["curve"]["x"])
        line = axis.plot(xs, entry["curve"]["mean"], "o", ms=3, label=f"layer {key}: binned mean")[0]
        # The log-space fit sits at the geometric mean; scale it to the binned means to compare shapes.
        means, fitted = torch.tensor(entry["curve"]["mean"]), torch.exp(entry["sigma"] * xs)
        scale = float(means.mean() / fitted.mean())
        grid = torch.linspace(0, 1, 101)
        axis.plot(grid, scale * torch.exp(entry["sigma"] * grid), "-", color=line.get_color(),
                  label=f"layer {key}: fit exp({entry['sigma']:.2f} x), scaled to the means")
    axis.set_xlabel("x = visual-token index / N0")
    axis.set_ylabel("attention (per-sample mean = 1)")
    axis.set_title(f"{result['method']} ({result['query']} query), {result['n_samples']} prompts")
    axis.legend(fontsize=7)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
