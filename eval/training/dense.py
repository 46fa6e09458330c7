"""The 64-token embedded LLaVA on the dense task version: tokenizer, auxiliary targets, training questions.

Used by :mod:`vtprune.eval.training.train` with ``--task dense`` (see :mod:`vtprune.shapes.dense`). The model
is the same tiny ``LlavaForConditionalGeneration`` as the 16-token one (:func:`tiny_models.build_llava`) at
224 px with 28 px patches: 8x8 = 64 visual tokens. What is specific to this version:

* the tokenizer adds the dense task's words (the 3x3 cell names, ``exactly``) after the first version's;
* the per-patch auxiliary heads (:data:`DENSE_AUX_HEADS`) predict for every patch the colour, shape and
  3x3 cell of the object covering it, and the digit drawn in it with its **place in the number** (first,
  second, third): reading the number is then reading the tokens whose place is 1, 2, 3 in turn;
* the extra training questions ask ``where3`` instead of the quadrant ``where``.

Also :func:`compact_checkpoint`: the small resumable checkpoint committed to git (fp32 weights, bf16 Adam
moments, fp16 best weights, step, elapsed time, learning curve).
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np
import torch
from vtprune.eval.training import models as M

from vtprune.shapes import dense as D
from vtprune.shapes import task as S

DENSE_MODEL_NAME = "vtprune-llava64-shapes"
DENSE_RUN_DIR = Path("runs") / "llava64"  # default workdir; the export goes to <workdir>/export
DENSE_MAX_TURNS = 10
DENSE_AUX_HEADS: dict[str, int] = {"color": len(S.COLORS) + 1, "shape": len(S.SHAPES) + 1, "cell": len(D.CELLS) + 1,
                                   "digit": 11, "place": 4}


def dense_texts() -> tuple[str, ...]:
    """Templates and answers of the dense version, for :func:`tiny_models.build_tokenizer` ``extra_texts``."""
    return tuple(D.DENSE_TEMPLATES.values()) + D.CELLS


def build_dense_tokenizer():
    """The first version's whole-word tokenizer plus the dense version's words (ids of old words unchanged)."""
    return M.build_tokenizer(extra_texts=dense_texts())


def dense_patch_labels(objects: list[S.SceneObject], grid: int, patch: int = 28, min_cover: float = 0.25
                       ) -> dict[str, np.ndarray]:
    """Per-patch class ids (row-major ``grid*grid``, 0 = none) for :data:`DENSE_AUX_HEADS`.

    ``color``/``shape``/``cell``: the best-covering shape (cover >= ``min_cover``); ``digit``: the digit
    (+1) whose box covers the patch best; ``place``: that digit's place in the number (1 = leftmost).
    """
    best = np.full((grid, grid), min_cover - 1e-6)
    out = {k: np.zeros((grid, grid), np.int64) for k in DENSE_AUX_HEADS}
    digits = sorted((o for o in objects if o.digit is not None), key=lambda o: o.box[0])
    place = {id(o): i + 1 for i, o in enumerate(digits)}
    for o in objects:
        win = M._box_cover(o.box, grid, patch) > best
        best = np.where(win, M._box_cover(o.box, grid, patch), best)
        if o.shape is not None:
            values = {"color": S.COLORS.index(o.color) + 1, "shape": S.SHAPES.index(o.shape) + 1,
                      "cell": D.CELLS.index(o.quadrant) + 1, "digit": 0, "place": 0}
        else:
            values = {"color": 0, "shape": 0, "cell": 0, "digit": int(o.digit) + 1, "place": place[id(o)]}
        for k, v in values.items():
            out[k][win] = v
    return {k: v.reshape(-1) for k, v in out.items()}


def dense_training_questions(sample: S.ImageSample, rng: np.random.Generator, max_turns: int = DENSE_MAX_TURNS
                             ) -> list[S.Question]:
    """The sample's questions plus extras about its other objects, shuffled, at most ``max_turns``.

    Extras: the colour of every uniquely shaped object, the shape of every uniquely coloured one, the 3x3
    cell of every unique colour-shape pair, and the count of every shape seen at most 5 times (0 included).
    Every question of the sample itself is kept.
    """
    base = list(sample.questions)
    seen = {q.text for q in base}
    shapes = sample.shapes
    t = D.DENSE_TEMPLATES
    extra: list[S.Question] = []
    for o in shapes:
        if sum(p.shape == o.shape for p in shapes) == 1:
            extra.append(S.Question("color", t["color"].format(shape=o.shape), o.color, [o.box]))
        if sum(p.color == o.color for p in shapes) == 1:
            extra.append(S.Question("shape", t["shape"].format(color=o.color), o.shape, [o.box]))
        if sum((p.color, p.shape) == (o.color, o.shape) for p in shapes) == 1:
            extra.append(S.Question("where3", t["where3"].format(color=o.color, shape=o.shape), o.quadrant, [o.box]))
    for shape in S.SHAPES:
        same = [o.box for o in shapes if o.shape == shape]
        if len(same) <= D.MAX_COUNT:
            extra.append(S.Question("count", t["count"].format(plural=S.PLURALS[shape]), str(len(same)), same))
    extra = [q for q in extra if q.text not in seen]
    extra = [extra[i] for i in rng.permutation(len(extra))][: max(0, max_turns - len(base))]
    qs = base + extra
    return [qs[i] for i in rng.permutation(len(qs))]


class DenseData:
    """Sample source for training: the dense stream with a curriculum on scene difficulty."""

    def __init__(self, cfg: D.DenseConfig, curriculum_steps: int):
        self.cfg, self.curriculum_steps = cfg, curriculum_steps

    def difficulty(self, step: int) -> float:
        """0 -> 1 linearly over the first ``curriculum_steps`` steps (1 throughout when 0)."""
        return 1.0 if self.curriculum_steps <= 0 else min(1.0, step / self.curriculum_steps)

    def train(self, step: int, batch: int) -> list[S.ImageSample]:
        d = self.difficulty(step)
        return [D.generate_dense_sample(S.SPLIT_SEEDS["train"], step * batch + i, self.cfg, d) for i in range(batch)]

    def split(self, name: str, n: int) -> list[S.ImageSample]:
        return D.make_dense_split(name, n, self.cfg)


def build_dense_parts(args: argparse.Namespace) -> dict:
    """Tokenizer, processor, model, auxiliary head, batcher and data of the 64-token LLaVA for ``Trainer``."""
    cfg = D.DenseConfig(image_size=args.image_size, patch=args.patch_size)
    tok = build_dense_tokenizer()
    model = M.build_llava(tok, args.image_size, vision_width=args.vision_width, text_width=args.text_width,
                          layers=args.layers, patch_size=args.patch_size)
    return {
        "cfg": cfg, "tok": tok, "model": model,
        "processor": M.build_llava_processor(tok, args.image_size, args.patch_size),
        "aux": M.AuxHead(model.config.vision_config.hidden_size, DENSE_AUX_HEADS, {}, balanced=args.aux_balanced),
        "batcher": M.LlavaBatcher(tok, args.image_size, args.patch_size, questions=dense_training_questions,
                                  labels=dense_patch_labels),
        "data": DenseData(cfg, args.curriculum_steps),
    }


@torch.no_grad()
def warm_start(model, path: str | Path) -> list[str]:
    """Copy an exported tiny LLaVA's weights (e.g. the shipped 16-token one) into the 64-token ``model``.

    Same-shaped tensors are copied; the CLIP position embeddings (CLS + g0 x g0 grid) are resized
    bilinearly to the new grid, so every patch starts with the embedding of the same relative place; the
    token embeddings and the LM head keep the rows of the old vocabulary (the dense tokenizer only appends
    words) and the new words start from their random init. Returns notes on what was not copied as is.
    """
    from transformers import LlavaForConditionalGeneration

    src = LlavaForConditionalGeneration.from_pretrained(path).state_dict()
    notes = []
    for key, dst in model.state_dict().items():
        old = src.get(key)
        if old is None or key.endswith("position_ids"):
            notes.append(f"{key}: kept (not in {path})" if old is None else f"{key}: kept (buffer)")
        elif old.shape == dst.shape:
            dst.copy_(old)
        elif key.endswith("position_embedding.weight"):
            g0, g1 = round((old.shape[0] - 1) ** 0.5), round((dst.shape[0] - 1) ** 0.5)
            grid = old[1:].T.reshape(1, -1, g0, g0)
            new = torch.nn.functional.interpolate(grid, size=(g1, g1), mode="bilinear", align_corners=False)
            dst.copy_(torch.cat([old[:1], new.reshape(-1, g1 * g1).T]))
            notes.append(f"{key}: {g0}x{g0} grid resized to {g1}x{g1}")
        elif old.shape[1:] == dst.shape[1:] and old.shape[0] < dst.shape[0]:
            dst[: old.shape[0]].copy_(old)
            notes.append(f"{key}: {old.shape[0]} rows copied, {dst.shape[0] - old.shape[0]} new")
        else:
            raise ValueError(f"warm start: {key} has shape {tuple(old.shape)} in {path}, {tuple(dst.shape)} here")
    return notes


def upweight_long_answers(labels: torch.Tensor, weights: torch.Tensor, factor: float) -> torch.Tensor:
    """``weights`` with every answer longer than two tokens (a number: 2-3 digits and ``</s>``) times ``factor``.

    ``tiny_models.answer_weights`` gives each answer total weight 1, so each digit of a three-digit number
    weighs a quarter of an answer while a colour word weighs half; ``factor`` 3 lets each digit of a 3-digit
    number count about as much as one word answer.
    """
    out = weights.clone()
    for b in range(labels.shape[0]):
        row = (labels[b] != -100).tolist()
        t = 0
        while t < len(row):
            u = t
            while u < len(row) and row[u]:
                u += 1
            if u - t > 2:
                out[b, t:u] *= factor
            t = u + 1 if u == t else u
    return out


class DigitReadout:
    """Auxiliary loss on the LM's own output at the digit tokens: each names its digit through the LM head.

    The logits at visual positions are otherwise unused; training the ones over digit patches to predict
    the digit's word (``0``..``9``) puts the digit, in the LM head's own basis, into the residual stream of
    the digit tokens, so an answer position that attends to a digit token can pass it on as it is. No
    attention weight is trained directly.
    """

    def __init__(self, tok):
        self.image_id = tok.convert_tokens_to_ids("<image>")
        self.ids = torch.tensor([0] + [tok.convert_tokens_to_ids(str(d)) for d in range(10)])

    def loss(self, input_ids: torch.Tensor, logits: torch.Tensor, digit_labels: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, T, V] of ``input_ids`` [B, T]; ``digit_labels`` [B, P] (0 = no digit, d + 1)."""
        visual = logits[input_ids == self.image_id].reshape(digit_labels.shape[0], digit_labels.shape[1], -1)
        on = digit_labels > 0
        return torch.nn.functional.cross_entropy(visual[on], self.ids[digit_labels[on]])


def dense_card_data(args: argparse.Namespace) -> str:
    """The model card's data paragraph for the dense task version."""
    return (f"vtprune-shapes **dense** task version (`vtprune.shapes.dense`, {D.DENSE_VERSION}): {args.image_size} "
            f"px images of 6-12 shapes (20-28 px) and a 2-3 digit number drawn one digit per {args.patch_size} px "
            f"patch, generated on the fly from the `train` seed stream; question types {', '.join(D.DENSE_QTYPES)} "
            f"(`where3`: the 3x3 cell). Scene curriculum: difficulty 0 -> 1 over the first {args.curriculum_steps} "
            f"steps (2-6 objects and no clutter at 0, 6-12 objects at 1). One question of each answerable type per "
            f"image plus extra colour/shape/where3/count questions, up to {DENSE_MAX_TURNS}, packed after one copy "
            f"of the image with a mask that shows each question only the image and itself; each answer weighs "
            f"the same in the loss. Validation = first {args.val_images} dense `val` images; test = first "
            f"{args.test_images} dense `test` images (all of their questions).")


def dense_card_optim(args: argparse.Namespace) -> str:
    """The model card's optimiser and auxiliary-loss paragraph for the dense task version."""
    start = f"warm start from `{args.init_from}` (`tiny_dense.warm_start`); " if args.init_from else ""
    return (f"{start}AdamW lr {args.lr}, betas 0.9/0.98, weight decay 0.05, {args.warmup} warmup steps then cosine "
            f"to 5 %, batch {args.batch} images, grad clip 1.0, fp32, seed {args.seed}; auxiliary per-patch loss "
            f"on the vision tower output (colour/shape/3x3 cell of the covering object, digit and its place in the "
            f"number; weight {args.aux_weight}{', balanced' if args.aux_balanced else ''}); number answers weigh "
            f"{args.read_weight}x; digit readout loss (the LM output at digit tokens names the digit, "
            f"`tiny_dense.DigitReadout`) weight {args.digit_readout}. Auxiliary heads dropped at save.")


# ----------------------------------------------------------------------------------------------------------
# The checkpoint kept in git
# ----------------------------------------------------------------------------------------------------------
def compact_checkpoint(src: str | Path, dst: str | Path) -> int:
    """Write a smaller resumable copy of the training checkpoint ``src`` to ``dst``; returns its size in bytes.

    Model and auxiliary weights stay fp32 (resume continues from them exactly); the Adam moments are stored
    in bf16 (``Optimizer.load_state_dict`` casts them back to fp32) and the best-so-far weights in fp16.
    """
    st = torch.load(src, weights_only=False)
    for state in st["opt"]["state"].values():
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state:
                state[k] = state[k].to(torch.bfloat16)
    score, best = st["best"]
    if best is not None:
        st["best"] = (score, {k: v.half() if v.is_floating_point() else v for k, v in best.items()})
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(st, dst.with_suffix(".tmp"))
    dst.with_suffix(".tmp").replace(dst)
    return dst.stat().st_size


def main(argv: list[str] | None = None) -> None:
    """``vtprune bench train-dense compact SRC DST``: write the git checkpoint."""
    from vtprune.cli.checks import OneLineParser, check_output_file
    from vtprune.cli.outputs import check_new_file

    p = OneLineParser(prog="vtprune bench train-dense", description=main.__doc__)
    p.add_argument("command", choices=["compact"])
    p.add_argument("src", type=Path, help="a training checkpoint (ckpt.pt of the workdir)")
    p.add_argument("dst", type=Path, help="where to write the compact checkpoint")
    p.add_argument("--force", action="store_true", help="replace an existing DST (default: refuse)")
    a = p.parse_args(argv)
    try:
        if not a.src.is_file():
            raise ValueError(f"SRC {str(a.src)!r} is not a checkpoint file; give the ckpt.pt of a training workdir.")
        check_output_file(a.dst, "DST")
        check_new_file(a.dst, a.force, "DST")
    except ValueError as error:
        p.error(str(error))
    try:
        size = compact_checkpoint(a.src, a.dst)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, RuntimeError) as error:
        p.error(f"SRC {str(a.src)!r} is not a training checkpoint ({type(error).__name__}: {str(error)[:80]}); give "
                "the ckpt.pt of a training workdir.")
    print(f"wrote {a.dst} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
