"""Tiny Qwen2-VL for vtprune-shapes: tokenizer, processor (torchvision-free), model and training batches.

Qwen processors cannot be saved whole without torchvision (no video processor), so an export holds the
tokenizer (with the chat template) and the image processor; rebuild the processor with
:func:`load_qwen_processor` (``AutoTokenizer`` + ``AutoImageProcessor`` + :class:`NoVideoQwen2VLProcessor`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen2VLProcessor
from vtprune.eval.training import models as M

from vtprune.shapes import task as S
from vtprune.shapes.video import open_form

QWEN_IMAGE_SIZE = 112  # 8x8 patches of 14 px -> 4x4 = 16 LM tokens after the 2x2 merge (the shipped model)
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class NoVideoQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor that accepts ``video_processor=None`` (the video processor needs torchvision)."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


def build_qwen_tokenizer():
    tok = M.build_tokenizer(M.QWEN_SPECIALS, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    tok.eos_token = "<|im_end|>"
    return tok


def build_qwen_processor(tok, image_size: int = QWEN_IMAGE_SIZE) -> NoVideoQwen2VLProcessor:
    from transformers import Qwen2VLImageProcessor

    # Images are used at their own size between 56 px (4 tokens) and ``image_size`` (training images at
    # ``image_size``; video frames at 112 px -> 16 tokens each).
    ip = Qwen2VLImageProcessor(patch_size=14, merge_size=2,
                               size={"shortest_edge": 56 * 56, "longest_edge": image_size * image_size})
    return NoVideoQwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=None,
                                   chat_template=QWEN_CHAT_TEMPLATE)


def load_qwen_processor(path: str | Path) -> NoVideoQwen2VLProcessor:
    """Rebuild the processor of an exported tiny Qwen2-VL folder (offline)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ip = AutoImageProcessor.from_pretrained(path)
    return NoVideoQwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=None,
                                   chat_template=QWEN_CHAT_TEMPLATE)


def save_qwen_processor(processor: NoVideoQwen2VLProcessor, path: str | Path) -> None:
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)


def build_qwen2vl(tok, vision_width: int = 128, text_width: int = 192, layers: int = 4):
    """A tiny from-scratch Qwen2VLForConditionalGeneration (head_dim 48 -> mrope_section [8, 8, 8])."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {k: tok.convert_tokens_to_ids(t) for k, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 8, 8]}
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=text_width, intermediate_size=2 * text_width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_parameters=rope, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id),
        vision_config=dict(depth=layers, embed_dim=vision_width, hidden_size=text_width, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        **ids,
    )
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    model = Qwen2VLForConditionalGeneration(cfg)
    gc = model.generation_config
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    return model


def vision_features(output) -> torch.Tensor:
    """Merged visual tokens from the ``model.model.visual`` forward output (hook helper), flat [N, D]."""
    return output.pooler_output


class QwenBatcher:
    """Single-turn questions packed after one image (see :func:`vtprune.eval.training.models.packed_attention`).

    The text is ``<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>`` followed, per question, by
    ``{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n``: with the packed mask and
    :func:`packed_rope_positions`, every turn sees exactly its single-turn chat-template prompt.
    Labels: the answer and its ``<|im_end|>``.
    """

    PREFIX = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, processor: NoVideoQwen2VLProcessor, image_size: int = QWEN_IMAGE_SIZE):
        self.p = processor
        self.grid = image_size // 28
        tok = processor.tokenizer
        self.start = tok.convert_tokens_to_ids("<|im_start|>")
        self.end = tok.eos_token_id
        self.assistant = tok.convert_tokens_to_ids("assistant")
        self.vision_end = tok.convert_tokens_to_ids("<|vision_end|>")

    def segments(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, T]: 0 up to ``<|vision_end|>``, then turn k >= 1 (each ends with its second ``<|im_end|>``), -1 pad."""
        seg = torch.full_like(ids, -1)
        for b in range(ids.shape[0]):
            row, turn, ends, in_prefix = ids[b].tolist(), 1, 0, True
            for i, t in enumerate(row):
                if not valid[b, i]:
                    continue
                seg[b, i] = 0 if in_prefix else turn
                if in_prefix and t == self.vision_end:
                    in_prefix = False
                elif not in_prefix and t == self.end:
                    ends += 1
                    if ends % 2 == 0:
                        turn += 1
        return seg

    def __call__(self, samples: list[S.ImageSample], rng: np.random.Generator) -> dict:
        texts = []
        for s in samples:
            turns = "".join(f"{q.text}<|im_end|>\n<|im_start|>assistant\n{q.answer}<|im_end|>\n"
                            for q in M.training_questions(s, rng))
            texts.append(self.PREFIX + turns)
        self.p.tokenizer.padding_side = "right"
        enc = self.p(images=[s.image for s in samples], text=texts, return_tensors="pt", padding=True)
        self.p.tokenizer.padding_side = "left"
        aux = [M.patch_labels(s.objects, self.grid, patch=28) for s in samples]
        ids = enc["input_ids"]
        return {"inputs": dict(enc), "labels": assistant_labels(ids, self.start, self.assistant, self.end),
                "segments": self.segments(ids, enc["attention_mask"].bool()),
                "aux": {k: torch.from_numpy(np.stack([a[k] for a in aux])) for k in M.AUX_HEADS}}


def packed_rope_positions(model, inputs: dict, segments: torch.Tensor) -> torch.Tensor:
    """M-RoPE position ids of the packed batch: each turn restarts where the first turn starts."""
    pos, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                        None, attention_mask=inputs["attention_mask"])
    pos = pos.clone()
    for b in range(segments.shape[0]):
        seg = segments[b]
        first = int((seg == 1).nonzero()[0])
        for turn in seg.unique().tolist():
            if turn >= 2:
                idx = (seg == turn).nonzero().flatten()
                pos[..., b, idx] = pos[..., b, first, None] + torch.arange(len(idx))
    return pos


def packed_inputs(model, batch: dict) -> dict:
    """Model inputs for a :class:`QwenBatcher` batch: 4-D packed mask and per-turn M-RoPE positions."""
    inputs = dict(batch["inputs"])
    inputs["position_ids"] = packed_rope_positions(model, inputs, batch["segments"])
    inputs["attention_mask"] = M.packed_attention(batch["segments"])
    return inputs


def assistant_labels(ids: torch.Tensor, start: int, assistant: int, end: int) -> torch.Tensor:
    """Labels [B, T]: the tokens of every assistant turn (after ``<|im_start|>assistant``) up to ``<|im_end|>``."""
    labels = torch.full_like(ids, -100)
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        for i in range(len(row) - 1):
            if row[i] == start and row[i + 1] == assistant:
                j = i + 2
                while j < len(row) and row[j] != end:
                    labels[b, j] = row[j]
                    j += 1
                if j < len(row):
                    labels[b, j] = row[j]
    return labels


def training_frames(clip: S.VideoSample, question: S.Question, rng: np.random.Generator,
                    frames: tuple[int, int] = (2, 12), p_evidence: float = 0.75) -> list[int]:
    """Sorted frame indices for one training sequence: 2-12 frames, with an evidence frame with ``p_evidence``.

    Sequences without evidence teach the model to spread its letter posterior when it cannot see the
    answer, which is the signal GridProbe's probe confidence reads.
    """
    total = len(clip.frames)
    n = int(rng.integers(frames[0], min(frames[1], total) + 1))
    evidence = set(question.frames)
    others = [t for t in range(total) if t not in evidence]
    if rng.random() < p_evidence:
        k = int(rng.integers(1, min(n, len(evidence)) + 1))
        picked = list(rng.choice(sorted(evidence), k, replace=False)) + list(rng.choice(others, n - k, replace=False))
    else:
        picked = list(rng.choice(others, min(n, len(others)), replace=False))
    return sorted(int(t) for t in picked)


class QwenVideoBatcher:
    """Clip questions (frames as consecutive images, the vtprune ``images`` route), each asked twice.

    Once as multiple choice (answer: the letter) and once open-ended (options removed, answer: the word,
    :func:`vtprune.shapes.video.open_form`), each with its own frame draw.
    """

    def __init__(self, processor: NoVideoQwen2VLProcessor):
        self.p = processor
        tok = processor.tokenizer
        self.ids = (tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("assistant"),
                    tok.eos_token_id)

    def __call__(self, clips: list[S.VideoSample], rng: np.random.Generator) -> dict:
        texts, images = [], []
        for clip in clips:
            for q in clip.questions:
                for text, answer in ((q.text, q.answer), open_form(q)):
                    picked = training_frames(clip, q, rng)
                    images += [clip.frames[t] for t in picked]
                    content = [{"type": "image"}] * len(picked) + [{"type": "text", "text": text}]
                    msgs = [{"role": "user", "content": content},
                            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
                    texts.append(self.p.apply_chat_template(msgs))
        self.p.tokenizer.padding_side = "right"
        enc = self.p(images=images, text=texts, return_tensors="pt", padding=True)
        self.p.tokenizer.padding_side = "left"
        return {"inputs": dict(enc), "labels": assistant_labels(enc["input_ids"], *self.ids)}
