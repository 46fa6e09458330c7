"""Evaluation (batched generate through the real processor), learning-curve plot and model card for tiny VLMs."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from vtprune.shapes import task as S
from vtprune.shapes.dense import DENSE_QTYPES

QTYPE_KEYS: tuple[str, ...] = S.QTYPES + tuple(q for q in DENSE_QTYPES if q not in S.QTYPES)  # both task versions


def llava_prompt(processor, question: str) -> str:
    """The exact single-turn prompt the model was trained on, via the processor's chat template."""
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return processor.apply_chat_template(msgs, add_generation_prompt=True)


@torch.no_grad()
def answer_batch(model, processor, images: list[Image.Image], questions: list[str], max_new_tokens: int = 4
                 ) -> list[str]:
    """Greedy answers for a batch (left padding), decoded with ``skip_special_tokens=True``."""
    prompts = [llava_prompt(processor, q) for q in questions]
    enc = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, enc["input_ids"].shape[1]:]
    return [a.strip() for a in processor.batch_decode(new, skip_special_tokens=True)]


def evaluate(model, processor, samples: list[S.ImageSample], batch_size: int = 64,
             max_questions: int | None = None) -> dict[str, float]:
    """Exact-match accuracy per question type and overall (mean over questions) on ``samples``."""
    items = [(s.image, q) for s in samples for q in s.questions][:max_questions]
    was_training = model.training
    model.eval()
    hits: dict[str, list[int]] = collections.defaultdict(list)
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        preds = answer_batch(model, processor, [im for im, _ in chunk], [q.text for _, q in chunk])
        for (_, q), p in zip(chunk, preds, strict=True):
            hits[q.qtype].append(int(p == q.answer))
    model.train(was_training)
    acc = {t: sum(h) / len(h) for t, h in hits.items() if h}
    acc["overall"] = sum(sum(h) for h in hits.values()) / max(1, sum(len(h) for h in hits.values()))
    return acc


def plot_curve(rows: list[dict], path: Path, keys: tuple[str, ...] = ("overall",) + QTYPE_KEYS + ("video",)) -> None:
    """Tiny dependency-free PNG of eval accuracy vs. training minutes (PIL only)."""
    w, h, m = 640, 400, 48
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.rectangle([m, m // 2, w - m // 2, h - m], outline="black")
    tmax = max([r["minutes"] for r in rows] + [1e-6])
    keys = tuple(k for k in keys if any(k in r for r in rows))
    colors = ["black", "red", "green", "blue", "orange", "purple", "brown", "teal", "gray", "magenta"]
    for y in (0.25, 0.5, 0.75, 1.0):
        yy = h - m - y * (h - 1.5 * m)
        d.line([m, yy, w - m // 2, yy], fill=(220, 220, 220))
        d.text((4, yy - 6), f"{y:.2f}", fill="black")
    for k, col in zip(keys, colors, strict=False):
        pts = [(m + r["minutes"] / tmax * (w - 1.5 * m), h - m - r[k] * (h - 1.5 * m)) for r in rows if k in r]
        if len(pts) > 1:
            d.line(pts, fill=col, width=2)
        d.text((w - m // 2 - 90, m // 2 + 4 + 12 * keys.index(k)), k, fill=col)
    d.text((w // 2 - 60, h - m + 16), f"training minutes (max {tmax:.0f})", fill="black")
    img.save(path)


def _table(rows: list[dict], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    body = ""
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def write_card(out: Path, info: dict, curve: list[dict], test_acc: dict[str, float] | None) -> None:
    """Write README.md (model card) and learning_curve.png into ``out``."""
    if curve:
        plot_curve(curve, out / "learning_curve.png")
    keys = ("overall",) + QTYPE_KEYS + ("video", "video_blind", "video_open")
    cols = ["minutes", "step", "loss", "aux_loss"] + [k for k in keys if curve and k in curve[-1]]
    test = ("Accuracy per question type on the held-out **test** split (no pruning, exact match):\n\n"
            + _table([{k: float(v) for k, v in test_acc.items()}], list(test_acc)) if test_acc
            else "_Test evaluation not run yet (exported while training runs; see the learning curve)._\n")
    text = f"""# {info['name']}

A tiny `{info['class']}` trained **from scratch on CPU** on the synthetic task
[vtprune-shapes](../../../docs/shapes_task.md). It is vtprune's embedded test model: the real transformers classes
at a size that runs anywhere, trained until it answers from the image, so visual-token pruning changes real answers.

## Architecture
{info['arch']}

Parameters: **{info['params']:,}** ({info['params_vision']:,} in the vision tower). Weights: safetensors, fp32.

## Prompt
`{info['prompt']}` (the processor's chat template produces it); the answer is one word
(numbers are spelt digit by digit, e.g. `3 ##5 ##2` -> "352") followed by `{info.get('eos', '</s>')}`:
generate with `max_new_tokens=4` and `processor.batch_decode(..., skip_special_tokens=True)`.

## Data and training
{info['data']}

Training: {info['steps']} steps ({info['samples']:,} images, several single-turn questions packed per image),
{info['minutes']:.1f} min wall time on {info['threads']} CPU thread(s) (status: {info['status']}).
{info['optim']}

## Results
{test}
## Learning curve (validation split)
![learning curve](learning_curve.png)

{_table(curve, cols) if curve else ''}
## Reproduce
```bash
{info['command']}
```
"""
    (out / "README.md").write_text(text)


def clip_frames(clip: S.VideoSample, question: S.Question, total: int = 8) -> list[int]:
    """The question's evidence frames plus uniformly spaced other frames, ``total`` in all, in time order."""
    evidence = sorted(question.frames)
    others = [t for t in range(len(clip.frames)) if t not in question.frames]
    need = max(0, total - len(evidence))
    picked = [others[round(i * (len(others) - 1) / max(1, need - 1))] for i in range(need)] if need else []
    return sorted(set(evidence) | set(picked))


@torch.no_grad()
def evaluate_video(model, processor, clips: list[S.VideoSample], total: int = 8, batch_size: int = 16
                   ) -> dict[str, float]:
    """Multiple-choice accuracy (argmax letter posterior) with all evidence frames among ``total`` frames.

    Also ``video_blind``: the accuracy without any evidence frame (chance is 0.25; above it means the model
    answers from what the distractors rule out).
    """
    from vtprune.gridprobe import letter_posterior, letter_token_ids
    from vtprune.media.video import frame_inputs

    ids = letter_token_ids(processor.tokenizer, list(S.OPTION_LETTERS))
    was_training = model.training
    model.eval()
    acc = {}
    for key, with_evidence in (("video", True), ("video_blind", False)):
        items = []
        for clip in clips:
            for q in clip.questions:
                picked = clip_frames(clip, q, total)
                if not with_evidence:
                    others = [t for t in range(len(clip.frames)) if t not in q.frames]
                    picked = [others[round(i * (len(others) - 1) / (total - 1))] for i in range(total)]
                items.append(([clip.frames[t] for t in picked], q))
        hits = []
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            enc = frame_inputs(processor, model.config.model_type, [f for f, _ in chunk], [q.text for _, q in chunk],
                               route="images")
            logits = model(**enc, logits_to_keep=1).logits[:, -1]
            pred = letter_posterior(logits, ids).argmax(dim=-1).tolist()
            hits += [int(S.OPTION_LETTERS[p] == q.answer) for p, (_, q) in zip(pred, chunk, strict=True)]
        acc[key] = sum(hits) / max(1, len(hits))
    acc["video_open"] = _open_video_accuracy(model, processor, clips, total, batch_size)
    model.train(was_training)
    return acc


def _open_video_accuracy(model, processor, clips: list[S.VideoSample], total: int, batch_size: int) -> float:
    """Open-ended form (options removed): is the answer word the likeliest of the four option words?"""
    from vtprune.media.video import frame_inputs
    from vtprune.shapes.video import open_form

    tok = processor.tokenizer
    items = [(clip, q) for clip in clips for q in clip.questions]
    hits = []
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        frames = [[clip.frames[t] for t in clip_frames(clip, q, total)] for clip, q in chunk]
        forms = [open_form(q) for _, q in chunk]
        enc = frame_inputs(processor, model.config.model_type, frames, [f[0] for f in forms], route="images")
        logits = model(**enc, logits_to_keep=1).logits[:, -1]
        for row, (_, q) in enumerate(chunk):
            words = re.findall(r"\b[A-D]\. (\S+)", q.text)
            ids = [tok.convert_tokens_to_ids(w) for w in words]
            hits.append(int(words[int(logits[row, ids].argmax())] == forms[row][1]))
    return sum(hits) / max(1, len(hits))
