"""Tokenizer, processors, tiny model configs and per-patch auxiliary targets for the embedded vtprune VLMs.

Used by :mod:`vtprune.eval.training.train`. The tokenizer is a whole-word vocabulary (the task's template words,
answers and specials) run through a ``tokenizers`` WordPiece model: every word is one token, and numbers
are spelt digit by digit ("352" -> ``3 ##5 ##2``) so that decoding glues them back to "352".
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import PreTrainedTokenizerFast

from vtprune.shapes import task as S

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
SPECIALS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>", "<image>")
QWEN_SPECIALS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
)
CHAT_WORDS: tuple[str, ...] = ("USER", "ASSISTANT", "user", "assistant", "system", ":", "?", ".", ",")

# LLaVA-1.5 style prompt: "USER: <image>\n{q} ASSISTANT:" ; the assistant turn is " {a}</s>".
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %} "
    "{% else %}ASSISTANT: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def task_words(extra_texts: tuple[str, ...] = ()) -> list[str]:
    """Every word the shapes task (images and videos) can produce, in a stable order.

    ``extra_texts`` (templates and answers of another task version) add their new words at the end, so the
    ids of the first version's words do not move.
    """
    texts = list(S.TEMPLATES.values()) + list(S.VIDEO_TEMPLATES.values()) + [S.VIDEO_SUFFIX] + list(extra_texts)
    words: list[str] = list(CHAT_WORDS)
    fill = list(S.COLORS) + list(S.SHAPES) + list(S.PLURALS.values()) + list(S.QUADRANTS) + list(S.YES_NO)
    fill += list(S.OPTION_LETTERS) + [str(d) for d in range(10)] + [f"##{d}" for d in range(10)]
    for t in texts:
        for w in t.replace("?", " ").replace(".", " ").split():
            if not w.startswith("{"):
                fill.append(w)
    for w in fill:
        if w not in words:
            words.append(w)
    return words


def build_tokenizer(
    extra_specials: tuple[str, ...] = (), named: dict[str, str] | None = None, extra_texts: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """Whole-word tokenizer; ids 0..4 are ``<pad> <s> </s> <unk> <image>``, then ``extra_specials``.

    ``named`` sets the processor-visible special tokens (default ``{"image_token": "<image>"}``);
    ``extra_texts`` adds the words of another task version (:func:`task_words`).
    """
    specials = list(SPECIALS) + list(extra_specials)
    vocab = {t: i for i, t in enumerate(specials + task_words(extra_texts))}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=64))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"[^A-Za-z0-9\-#]"), behavior="isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", clean_up_tokenization_spaces=False,
        extra_special_tokens=named or {"image_token": "<image>"},
    )


def build_llava_processor(tok: PreTrainedTokenizerFast, image_size: int, patch_size: int = 14):
    """LlavaProcessor (CLIP image processor at ``image_size``, CLS dropped) with the chat template."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    ip = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        do_center_crop=True,
    )
    return LlavaProcessor(
        image_processor=ip, tokenizer=tok, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE,
    )


def build_llava(tok: PreTrainedTokenizerFast, image_size: int = 112, vision_width: int = 128,
                text_width: int = 192, layers: int = 4, patch_size: int = 14):
    """A tiny from-scratch LlavaForConditionalGeneration (CLIP vision + Llama text)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vcfg = CLIPVisionConfig(hidden_size=vision_width, intermediate_size=2 * vision_width, num_hidden_layers=layers,
                            num_attention_heads=4, image_size=image_size, patch_size=patch_size)
    tcfg = LlamaConfig(vocab_size=len(tok), hidden_size=text_width, intermediate_size=2 * text_width,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_id=tok.convert_tokens_to_ids("<image>"),
                      vision_feature_layer=-1, vision_feature_select_strategy="default",
                      projector_hidden_act="gelu")
    cfg.pad_token_id = tok.pad_token_id
    cfg.eos_token_id = tok.eos_token_id
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model


# ----------------------------------------------------------------------------------------------------------
# Dense auxiliary targets on the vision tower (dropped at save)
# ----------------------------------------------------------------------------------------------------------
AUX_HEADS: dict[str, int] = {"color": len(S.COLORS) + 1, "shape": len(S.SHAPES) + 1, "quadrant": 4, "digit": 11,
                             "digits": 11}
AUX_SLOTS: dict[str, int] = {"digits": 3}  # heads that predict several ordered labels per patch
DIGIT_SLOTS = AUX_SLOTS["digits"]


class AuxHead(nn.Module):
    """Linear per-patch classifiers on the vision tower's patch features.

    colour, shape, quadrant and digit label each patch with its best-covering object; ``digits`` predicts the
    digits whose centres fall in the patch, left to right, in :data:`DIGIT_SLOTS` slots (0 = none), so a
    patch that holds two digits of the number says which and in what order (reading needs that; one
    ``digit`` label per 28 px Qwen token cannot carry it, and 8 px digits never cover 25 % of such a token).
    """

    def __init__(self, width: int, heads: dict[str, int] | None = None, slots: dict[str, int] | None = None,
                 balanced: bool = False):
        """``balanced``: each head's loss is the mean of its background-patch and its labelled-patch means
        (so the few digit patches of an image are not outweighed by its background)."""
        super().__init__()
        self.balanced = balanced
        self.sizes = dict(AUX_HEADS if heads is None else heads)
        slots = AUX_SLOTS if slots is None else slots
        self.heads = nn.ModuleDict({k: nn.Linear(width, n * slots.get(k, 1)) for k, n in self.sizes.items()})

    def forward(self, feats: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over heads; ``feats`` [B, P, D], labels [B, P] (or [B, P, slots]) each."""
        if self.balanced:
            return torch.stack([self._balanced(h(feats).reshape(-1, self.sizes[k]), labels[k].flatten())
                                for k, h in self.heads.items()]).mean()
        losses = [nn.functional.cross_entropy(h(feats).reshape(-1, self.sizes[k]), labels[k].flatten())
                  for k, h in self.heads.items()]
        return torch.stack(losses).mean()

    @staticmethod
    def _balanced(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = nn.functional.cross_entropy(logits, labels, reduction="none")
        fg = labels > 0
        if not fg.any() or fg.all():
            return ce.mean()
        return 0.5 * ce[fg].mean() + 0.5 * ce[~fg].mean()


def digit_slots(objects: list[S.SceneObject], grid: int, patch: int) -> np.ndarray:
    """[grid*grid, DIGIT_SLOTS] digit ids + 1 of the digits centred in each patch, left to right; 0 = none."""
    slots = np.zeros((grid * grid, DIGIT_SLOTS), np.int64)
    digits = sorted((o for o in objects if o.digit is not None), key=lambda o: o.box[0])
    for o in digits:
        cx, cy = (o.box[0] + o.box[2]) / 2, (o.box[1] + o.box[3]) / 2
        cell = min(int(cy // patch), grid - 1) * grid + min(int(cx // patch), grid - 1)
        free = np.flatnonzero(slots[cell] == 0)
        if free.size:
            slots[cell, free[0]] = int(o.digit) + 1
    return slots


def _box_cover(box: S.Box, grid: int, patch: int) -> np.ndarray:
    """Fraction of each patch (grid x grid) covered by ``box``."""
    edges = np.arange(grid + 1) * patch
    ox = np.clip(np.minimum(edges[1:], box[2]) - np.maximum(edges[:-1], box[0]), 0, None)
    oy = np.clip(np.minimum(edges[1:], box[3]) - np.maximum(edges[:-1], box[1]), 0, None)
    return np.outer(oy, ox) / float(patch * patch)


def patch_labels(objects: list[S.SceneObject], grid: int, patch: int = 14, min_cover: float = 0.25
                 ) -> dict[str, np.ndarray]:
    """Per-patch class ids (row-major, ``grid*grid``) for the auxiliary heads; 0 = background/none.

    ``digits`` is [grid*grid, DIGIT_SLOTS] (:func:`digit_slots`); the others are [grid*grid].
    """
    best = np.full((grid, grid), min_cover - 1e-6)
    color = np.zeros((grid, grid), np.int64)
    shape = np.zeros((grid, grid), np.int64)
    digit = np.zeros((grid, grid), np.int64)
    for o in objects:
        cov = _box_cover(o.box, grid, patch)
        win = cov > best
        best = np.where(win, cov, best)
        if o.shape is not None:
            color[win], shape[win], digit[win] = S.COLORS.index(o.color) + 1, S.SHAPES.index(o.shape) + 1, 0
        else:
            color[win], shape[win], digit[win] = 0, 0, int(o.digit) + 1
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    quad = (rows >= grid / 2).astype(np.int64) * 2 + (cols >= grid / 2).astype(np.int64)
    return {"color": color.reshape(-1), "shape": shape.reshape(-1), "digit": digit.reshape(-1),
            "quadrant": quad.reshape(-1), "digits": digit_slots(objects, grid, patch)}


# ----------------------------------------------------------------------------------------------------------
# LLaVA training batches
# ----------------------------------------------------------------------------------------------------------
MAX_TURNS = 8


def training_questions(sample: S.ImageSample, rng: np.random.Generator, max_turns: int = MAX_TURNS
                       ) -> list[S.Question]:
    """The sample's questions plus extra questions about its other objects, shuffled.

    Extras: the colour of every uniquely shaped object, the shape of every uniquely coloured one, where every
    unique colour-shape pair is, and how many of each other shape there are (0 included). The colour/shape
    extras carry the binding signal that one question per type spreads too thinly (the first training run
    learned count and where but stayed at chance on colour); the where/count extras were added when those
    became the weak types of the Qwen model. Capped at ``max_turns``, always keeping one question of each type
    the sample has.
    """
    base = list(sample.questions)
    seen = {q.text for q in base}
    shapes = sample.shapes
    extra: list[S.Question] = []
    for o in shapes:
        if sum(p.shape == o.shape for p in shapes) == 1:
            extra.append(S.Question("color", S.TEMPLATES["color"].format(shape=o.shape), o.color, [o.box]))
        if sum(p.color == o.color for p in shapes) == 1:
            extra.append(S.Question("shape", S.TEMPLATES["shape"].format(color=o.color), o.shape, [o.box]))
        if sum((p.color, p.shape) == (o.color, o.shape) for p in shapes) == 1:
            extra.append(S.Question("where", S.TEMPLATES["where"].format(color=o.color, shape=o.shape),
                                    o.quadrant, [o.box]))
    for shape in S.SHAPES:
        same = [o.box for o in shapes if o.shape == shape]
        extra.append(S.Question("count", S.TEMPLATES["count"].format(plural=S.PLURALS[shape]), str(len(same)), same))
    extra = [q for q in extra if q.text not in seen]
    extra = [extra[i] for i in rng.permutation(len(extra))][: max(0, max_turns - len(base))]
    qs = base + extra
    return [qs[i] for i in rng.permutation(len(qs))]


def answer_weights(labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss weights: each answer (a run of labels != -100) gets total weight 1.

    So a three-digit "read" answer weighs as much as a one-word colour answer. ``labels`` [B, T] -> [B, T].
    """
    on = labels != -100
    w = torch.zeros(labels.shape, dtype=torch.float32)
    for b in range(labels.shape[0]):
        row = on[b].tolist()
        t = 0
        while t < len(row):
            if row[t]:
                u = t
                while u < len(row) and row[u]:
                    u += 1
                w[b, t:u] = 1.0 / (u - t)
                t = u
            else:
                t += 1
    return w


def packed_attention(segments: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, 1, T, T] (True = attend) for several single-turn questions packed after one image.

    ``segments`` [B, T]: 0 for the shared prefix (the image and what precedes it), k >= 1 for the tokens of
    question-answer turn k, -1 for padding. A token attends causally to the prefix and to its own turn only,
    so no turn can read another turn's answer (a text shortcut that otherwise replaces looking at the image:
    "Where is the red circle?" tells the answer to "What color is the circle?"). Padding rows see the prefix
    and themselves (never an empty row, which would give NaN).
    """
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    q, k = segments[:, :, None], segments[:, None, :]
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))
    allowed |= torch.eye(t, dtype=torch.bool)
    return allowed[:, None]


def packed_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T]: every turn restarts right after the prefix, as if asked alone."""
    pos = torch.zeros(segments.shape, dtype=torch.long)
    for b in range(segments.shape[0]):
        seg = segments[b].tolist()
        prefix = seg.count(0)
        counter: dict[int, int] = {}
        for i, s in enumerate(seg):
            if s <= 0:
                pos[b, i] = i if s == 0 else 0
            else:
                pos[b, i] = prefix + counter.get(s, 0)
                counter[s] = counter.get(s, 0) + 1
    return pos


class LlavaBatcher:
    """Turns shapes samples into (input_ids, labels, pixel_values, patch labels) tensors.

    The questions of one image are packed after one copy of the image with :func:`packed_attention`: each
    turn sees exactly the single-turn prompt ``USER: <image>\n{q} ASSISTANT:`` it is evaluated with.
    """

    def __init__(self, tok, image_size: int, patch_size: int = 14, questions=None, labels=None):
        """``questions(sample, rng)`` and ``labels(objects, grid, patch)`` default to this task version's
        :func:`training_questions` and :func:`patch_labels` (another task version passes its own)."""
        self.tok = tok
        self.questions = questions or training_questions
        self.labels = labels or patch_labels
        self.patch = patch_size
        self.grid = image_size // patch_size
        self.n_img = self.grid * self.grid
        self.image_id = tok.convert_tokens_to_ids("<image>")
        self.cache: dict[str, list[int]] = {}

    def _ids(self, text: str) -> list[int]:
        if text not in self.cache:
            self.cache[text] = self.tok(text, add_special_tokens=False)["input_ids"]
        return self.cache[text]

    def conversation(self, qs: list[S.Question]) -> tuple[list[int], list[int], list[int]]:
        """``(ids, labels, segments)`` for the packed turns of one image."""
        prefix = self._ids("USER: <image>")
        i = prefix.index(self.image_id)
        ids = prefix[:i] + [self.image_id] * self.n_img + prefix[i + 1:]
        labels, segments = [-100] * len(ids), [0] * len(ids)
        for k, q in enumerate(qs, start=1):
            p = self._ids(f"{q.text} ASSISTANT:")
            a = self._ids(" " + q.answer) + [self.tok.eos_token_id]
            ids += p + a
            labels += [-100] * len(p) + a
            segments += [k] * (len(p) + len(a))
        return ids, labels, segments

    def __call__(self, samples: list[S.ImageSample], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        seqs = [self.conversation(self.questions(s, rng)) for s in samples]
        n = max(len(i) for i, _, _ in seqs)
        pad = self.tok.pad_token_id
        ids = torch.tensor([i + [pad] * (n - len(i)) for i, _, _ in seqs])
        lab = torch.tensor([lb + [-100] * (n - len(lb)) for _, lb, _ in seqs])
        seg = torch.tensor([sg + [-1] * (n - len(sg)) for _, _, sg in seqs])
        aux = [self.labels(s.objects, self.grid, self.patch) for s in samples]
        inputs = {"input_ids": ids, "pixel_values": to_pixels([s.image for s in samples]),
                  "attention_mask": packed_attention(seg), "position_ids": packed_positions(seg)}
        return {"inputs": inputs, "labels": lab,
                "aux": {k: torch.from_numpy(np.stack([a[k] for a in aux])) for k in aux[0]}}


def to_pixels(images) -> torch.Tensor:
    """CLIP normalisation of already-sized images (identical to the CLIP processor at this size)."""
    arr = np.stack([np.asarray(im, np.float32) / 255.0 for im in images])
    return torch.from_numpy(((arr - CLIP_MEAN) / CLIP_STD).transpose(0, 3, 1, 2).copy())


def check_consistency(processor, batcher: LlavaBatcher, cfg: S.ShapesConfig, sample: S.ImageSample | None = None
                      ) -> None:
    """Every packed turn must equal what the shipped processor + chat template produce for it alone.

    Checked on ``sample`` (default: the first ``val`` image of this task version at ``cfg``).
    """
    s = sample or S.generate_image_sample(S.SPLIT_SEEDS["val"], 0, cfg)
    ids, _, segments = batcher.conversation(s.questions[:2])
    for turn, q in enumerate(s.questions[:2], start=1):
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q.text}]},
                {"role": "assistant", "content": [{"type": "text", "text": q.answer}]}]
        enc = processor(images=[s.image], text=[processor.apply_chat_template(msgs)], return_tensors="pt")
        alone = [t for t, g in zip(ids, segments, strict=True) if g in (0, turn)]
        if enc["input_ids"][0].tolist() != alone:
            raise RuntimeError(f"training tokens differ from the processor's: {alone} vs {enc['input_ids'][0].tolist()}")
    if not torch.allclose(enc["pixel_values"], to_pixels([s.image]), atol=1e-5):
        raise RuntimeError("pixel preprocessing differs from the processor's")
