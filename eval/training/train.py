"""Train vtprune's embedded tiny VLM from scratch on CPU on the vtprune-shapes task.

    vtprune bench train --arch llava --minutes 85 --out vtprune/models/vtprune-llava-shapes --force

Recipe (see docs/shapes_task.md and the model card): several questions per image, packed after one copy of
the image with a mask that lets each question see only the image and itself (so no question reads another's
answer), each answer weighing the same in the loss, plus a dense per-patch auxiliary loss on the vision tower
(colour, shape, digit and image quadrant of every patch); the auxiliary head is not part of the saved model.
The learning rate follows warmup + cosine over ``--steps`` or, with ``--minutes``, over the wall-clock budget.
The current best checkpoint (by validation accuracy) is exported every ``--export-every`` minutes.

``--task dense`` trains the 64-token LLaVA on the dense task version (224 px, 6-12 objects, one digit per
28 px patch, 3x3 ``where3``; :mod:`vtprune.shapes.dense`, :mod:`vtprune.eval.training.dense`); its default
workdir is ``runs/llava64`` and its export ``runs/llava64/export`` (never the shipped models). Long runs
go in legs: ``--leg-minutes`` stops a leg with a checkpoint, ``--resume`` (or ``--resume-from FILE``, e.g.
the committed compact checkpoint) continues it on the same ``--steps`` schedule. A fresh run does not start
over an earlier run's checkpoint or exported model without ``--force`` (:mod:`vtprune.eval.training.options`).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
from vtprune.eval.training import dense as TD
from vtprune.eval.training import evaluate as E
from vtprune.eval.training import models as M
from vtprune.eval.training import options
from vtprune.eval.training import qwen as Q

from vtprune.models.embedded import EMBEDDED_MODELS
from vtprune.shapes import task as S
from vtprune.shapes import video as V


# ----------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------
def lr_factor(step: int, progress: float, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    """Holds model, aux head, optimiser and progress; supports checkpoint/resume and periodic export."""

    def __init__(self, args: argparse.Namespace):
        self.a = args
        torch.manual_seed(args.seed)
        self.cfg = S.ShapesConfig(image_size=args.image_size)
        self.data = None
        if args.task == "dense":
            parts = TD.build_dense_parts(args)
            self.cfg, self.data, self.tok, self.processor = parts["cfg"], parts["data"], parts["tok"], parts["processor"]
            self.model, self.aux, self.batcher = parts["model"], parts["aux"], parts["batcher"]
            self.model.model.vision_tower.register_forward_hook(self._grab)
            if args.init_from:
                for note in TD.warm_start(self.model, args.init_from):
                    log(f"warm start: {note}")
        elif args.arch == "llava":
            self.tok = M.build_tokenizer()
            self.processor = M.build_llava_processor(self.tok, args.image_size, args.patch_size)
            self.model = M.build_llava(self.tok, args.image_size, patch_size=args.patch_size)
            self.aux = M.AuxHead(self.model.config.vision_config.hidden_size)
            self.batcher = M.LlavaBatcher(self.tok, args.image_size, args.patch_size)
            self.model.model.vision_tower.register_forward_hook(self._grab)
        else:
            self.tok = Q.build_qwen_tokenizer()
            self.processor = Q.build_qwen_processor(self.tok, args.image_size)
            self.model = Q.build_qwen2vl(self.tok)
            self.aux = M.AuxHead(self.model.config.text_config.hidden_size)
            self.batcher = Q.QwenBatcher(self.processor, args.image_size)
            self.video_batcher = Q.QwenVideoBatcher(self.processor)
            self.model.model.visual.register_forward_hook(self._grab)
        params = list(self.model.parameters()) + list(self.aux.parameters())
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0}],
                                     lr=args.lr, betas=(0.9, 0.98))
        self.step, self.elapsed, self.curve, self.best = 0, 0.0, [], (-1.0, None)
        self.feats: torch.Tensor | None = None
        self.val = self.split("val", args.val_images)
        self.video_cfg = S.ShapesConfig()  # the video split is rendered at 112 px (16 Qwen tokens per frame)
        self.val_clips = ([V.generate_video_sample(S.SPLIT_SEEDS["val"], i, self.video_cfg)
                           for i in range(args.val_clips)] if args.video_clips else [])

    def split(self, name: str, n: int) -> list[S.ImageSample]:
        """The first ``n`` images of split ``name`` of this task version."""
        return self.data.split(name, n) if self.data else S.make_split(name, n, self.cfg)

    def _grab(self, module, inputs, output) -> None:
        """Patch features for the aux loss: CLIP output minus CLS, or Qwen's merged tokens (flat)."""
        self.feats = output.last_hidden_state[:, 1:] if self.a.arch == "llava" else Q.vision_features(output)

    def progress(self) -> float:
        ps = [self.step / self.a.steps] if self.a.steps else []
        ps += [self.elapsed / (60 * self.a.minutes)] if self.a.minutes else []
        return max(ps)

    def train_step(self) -> tuple[float, float]:
        b = self.a.batch
        samples = (self.data.train(self.step, b) if self.data else
                   [S.generate_image_sample(S.SPLIT_SEEDS["train"], self.step * b + i, self.cfg) for i in range(b)])
        batch = self.batcher(samples, np.random.default_rng([self.a.seed, self.step]))
        for g in self.opt.param_groups:
            g["lr"] = self.a.lr * lr_factor(self.step, self.progress(), self.a.warmup)
        inputs = Q.packed_inputs(self.model, batch) if "segments" in batch else batch["inputs"]
        logits = self.model(**inputs).logits
        lab = batch["labels"][:, 1:]
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), lab.flatten(), ignore_index=-100,
                                               reduction="none")
        w = M.answer_weights(lab)
        if self.a.read_weight != 1.0:
            w = TD.upweight_long_answers(lab, w, self.a.read_weight)
        w = w.flatten()
        lm = (ce * w).sum() / w.sum()
        aux = self.aux(self.feats.reshape(b, -1, self.feats.shape[-1]), batch["aux"])
        loss = lm + self.a.aux_weight * aux
        if getattr(self.a, "digit_readout", 0.0):
            readout = TD.DigitReadout(self.tok).loss(inputs["input_ids"], logits, batch["aux"]["digit"])
            loss = loss + self.a.digit_readout * readout
        if self.a.video_clips:
            loss = loss + self.video_loss()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()) + list(self.aux.parameters()), 1.0)
        self.opt.step()
        self.step += 1
        return lm.item(), aux.item()

    def video_loss(self) -> torch.Tensor:
        """Answer loss on multiple-choice clip questions (frames as images; some without evidence)."""
        n = self.a.video_clips
        clips = [V.generate_video_sample(S.SPLIT_SEEDS["train"], self.step * n + i, self.video_cfg) for i in range(n)]
        batch = self.video_batcher(clips, np.random.default_rng([self.a.seed, self.step, 1]))
        logits = self.model(**batch["inputs"]).logits
        lab = batch["labels"][:, 1:]
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), lab.flatten(), ignore_index=-100)

    # -- checkpoints ------------------------------------------------------------------------------------
    def save_ckpt(self, path: Path) -> None:
        state = {"model": self.model.state_dict(), "aux": self.aux.state_dict(), "opt": self.opt.state_dict(),
                 "step": self.step, "elapsed": self.elapsed, "curve": self.curve, "best": self.best}
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def load_ckpt(self, path: Path) -> None:
        st = torch.load(path, weights_only=False)
        self.model.load_state_dict(st["model"])
        missing = self.aux.load_state_dict(st["aux"], strict=False).missing_keys
        self.opt.load_state_dict(grow_optimizer_state(st["opt"], self.opt.state_dict()) if missing else st["opt"])
        if missing:
            log(f"resume: new auxiliary heads start from scratch: {missing}")
        self.step, self.elapsed, self.curve, self.best = st["step"], st["elapsed"], st["curve"], st["best"]

    # -- eval / export ----------------------------------------------------------------------------------
    def evaluate_and_export(self, loss: float, aux: float, out: Path, workdir: Path) -> None:
        t0 = time.time()
        acc = E.evaluate(self.model, self.processor, self.val)
        if self.val_clips:
            acc.update(E.evaluate_video(self.model, self.processor, self.val_clips))
        row = {"minutes": round(self.elapsed / 60, 2), "step": self.step, "loss": round(loss, 4),
               "aux_loss": round(aux, 4), **{k: round(v, 4) for k, v in acc.items()}}
        self.curve.append(row)
        log(f"eval step {self.step}: " + " ".join(f"{k}={v:.3f}" for k, v in acc.items())
            + f" ({time.time() - t0:.0f}s)")
        write_curve_csv(self.curve, workdir / "learning_curve.csv")
        score = (acc["overall"] + max(acc["video"], acc["video_open"])) / 2 if "video" in acc else acc["overall"]
        if score >= self.best[0]:
            self.best = (score, copy.deepcopy(self.model.state_dict()))
            self.export(out, test_acc=None, status="best validation weights so far, exported while training runs")
        self.save_ckpt(workdir / "ckpt.pt")

    def export(self, out: Path, test_acc: dict | None, status: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        model = copy.deepcopy(self.model)
        if self.best[1] is not None:
            model.load_state_dict(self.best[1])
        model.save_pretrained(out)
        if self.a.arch == "llava":
            self.processor.save_pretrained(out)
        else:
            Q.save_qwen_processor(self.processor, out)
        write_curve_csv(self.curve, out / "learning_curve.csv")
        E.write_card(out, self.card_info(status), self.curve, test_acc)
        log(f"exported to {out} ({status})")

    def card_info(self, status: str) -> dict:
        m, a = self.model, self.a
        t = m.config.text_config
        llava = a.arch == "llava"
        vis = m.model.vision_tower if llava else m.model.visual
        text = (f"- text: {'LlamaForCausalLM' if llava else 'Qwen2-VL text model (M-RoPE)'}, width {t.hidden_size}, "
                f"{t.num_hidden_layers} layers, {t.num_attention_heads} heads, {t.num_key_value_heads} KV heads, "
                f"MLP {t.intermediate_size}, vocab {t.vocab_size} (whole-word tokenizer, digits spelt one by one)")
        return {
            "name": TD.DENSE_MODEL_NAME if a.task == "dense" else EMBEDDED_MODELS[a.arch], "class": type(m).__name__, "status": status,
            "params": sum(p.numel() for p in m.parameters()), "params_vision": sum(p.numel() for p in vis.parameters()),
            "eos": "</s>" if llava else "<|im_end|>", "steps": self.step, "minutes": self.elapsed / 60,
            "samples": self.step * a.batch, "threads": a.threads,
            "prompt": ("USER: <image>\\n{question} ASSISTANT:" if llava else
                       "<|im_start|>user\\n<|vision_start|><|image_pad|>...<|vision_end|>{question}<|im_end|>\\n"
                       "<|im_start|>assistant\\n"),
            "arch": self._arch_text(m) + "\n" + text,
            "data": TD.dense_card_data(a) if a.task == "dense" else (f"vtprune-shapes images at {a.image_size} px, generated on the fly from the `train` seed "
                     f"stream (one question of each answerable type per image plus extra colour/shape/where/count "
                     f"questions about its other objects, up to {M.MAX_TURNS}, packed after one copy of the image "
                     f"with a mask that shows each question only the image and itself; each answer weighs the same in the "
                     f"loss); "
                     f"validation = first {a.val_images} `val` images; test = first {a.test_images} "
                     f"`test` images (all of their questions)."),
            "optim": TD.dense_card_optim(a) if a.task == "dense" else (f"AdamW lr {a.lr}, betas 0.9/0.98, weight decay 0.05, {a.warmup} warmup steps then "
                      f"cosine to 5 %, batch {a.batch} images, grad clip 1.0, fp32, seed {a.seed}; "
                      f"auxiliary per-patch loss (colour/shape/digit/quadrant and the digit slots of "
                      f"`tiny_models.digit_slots`, weight {a.aux_weight}) "
                      "on the vision tower output, head dropped at save."),
            "command": "vtprune bench train " + " ".join(a.argv),
        }

    def _arch_text(self, m) -> str:
        v, size = m.config.vision_config, self.a.image_size
        if self.a.arch == "llava":
            g = size // v.patch_size
            return (f"- vision: CLIPVisionModel, width {v.hidden_size}, {v.num_hidden_layers} layers, "
                    f"{v.num_attention_heads} heads, MLP {v.intermediate_size}, patch {v.patch_size}, {size} px "
                    f"-> {g}x{g} = {g * g} visual tokens (CLS dropped: vision_feature_select_strategy='default', "
                    f"vision_feature_layer=-1)\n- projector: LLaVA 2-layer GELU MLP")
        g = size // 28
        return (f"- vision: Qwen2-VL ViT, width {v.embed_dim}, {v.depth} layers, {v.num_heads} heads, patch 14, "
                f"{size} px, 2x2 patch merger -> {g}x{g} = {g * g} visual tokens. Processor: rebuild with "
                "`vtprune.eval.training.qwen.load_qwen_processor(path)` (tokenizer + image processor are saved; "
                "the full Qwen processor cannot be saved without torchvision); pass `mm_token_type_ids`.")


def grow_optimizer_state(old: dict, new: dict) -> dict:
    """``old`` optimiser state mapped onto ``new``'s groups when parameters were appended to each group.

    New auxiliary heads come last in the parameter list, so within each group the old parameters are a
    prefix of the new ones; their moments carry over and the appended ones start empty.
    """
    state = {}
    for g_old, g_new in zip(old["param_groups"], new["param_groups"], strict=True):
        for i_old, i_new in zip(g_old["params"], g_new["params"], strict=False):
            if i_old in old["state"]:
                state[i_new] = old["state"][i_old]
    groups = [{**g_old, "params": g_new["params"]} for g_old, g_new in zip(old["param_groups"], new["param_groups"],
                                                                           strict=True)]
    return {"state": state, "param_groups": groups}


def write_curve_csv(rows: list[dict], path: Path) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's options (:func:`vtprune.eval.training.options.parse_args`)."""
    return options.parse_args(argv, __doc__)


def run(args: argparse.Namespace) -> None:
    dense = args.task == "dense"
    workdir = args.workdir or (TD.DENSE_RUN_DIR if dense else Path(".train") / args.arch)
    out = args.out or workdir / "export"  # never over the shipped models unless asked
    options.check_outputs(args, workdir, out)
    torch.set_num_threads(args.threads)
    workdir.mkdir(parents=True, exist_ok=True)
    tr = Trainer(args)
    if args.arch == "llava":
        M.check_consistency(tr.processor, tr.batcher, tr.cfg, tr.split("val", 1)[0])
    start = workdir / "ckpt.pt" if (workdir / "ckpt.pt").exists() else args.resume_from
    if (args.resume or args.resume_from) and start is not None and Path(start).exists():
        tr.load_ckpt(Path(start))
        log(f"resumed from {start} at step {tr.step} ({tr.elapsed / 60:.1f} min)")
    leg_end = tr.elapsed + 60 * args.leg_minutes if args.leg_minutes else math.inf
    log(f"params {sum(p.numel() for p in tr.model.parameters()):,}; out={out}")
    t_last, s_last, last_export = time.time(), tr.step, tr.elapsed
    lm_avg = aux_avg = None
    while tr.progress() < 1.0 and not args.finish:
        if tr.elapsed >= leg_end:
            if lm_avg is not None:
                tr.evaluate_and_export(lm_avg, aux_avg, out, workdir)
            log(f"leg done at step {tr.step}; resume with --resume --workdir {workdir}")
            return
        t0 = time.time()
        lm, aux = tr.train_step()
        tr.elapsed += time.time() - t0
        lm_avg = lm if lm_avg is None else 0.95 * lm_avg + 0.05 * lm
        aux_avg = aux if aux_avg is None else 0.95 * aux_avg + 0.05 * aux
        if tr.step % args.log_every == 0:
            sps = (tr.step - s_last) / (time.time() - t_last)
            t_last, s_last = time.time(), tr.step
            lr = tr.opt.param_groups[0]["lr"]
            log(f"step {tr.step} loss {lm_avg:.4f} aux {aux_avg:.4f} lr {lr:.2e} {sps:.2f} steps/s "
                f"train {tr.elapsed / 60:.1f} min")
        if tr.elapsed - last_export >= 60 * args.export_every:
            last_export = tr.elapsed
            tr.evaluate_and_export(lm_avg, aux_avg, out, workdir)
    if lm_avg is not None or tr.best[1] is None:
        tr.evaluate_and_export(lm_avg or 0.0, aux_avg or 0.0, out, workdir)
    final = copy.deepcopy(tr.model)
    final.load_state_dict(tr.best[1])
    test = E.evaluate(final, tr.processor, tr.split("test", args.test_images))
    if args.video_clips:
        clips = [V.generate_video_sample(S.SPLIT_SEEDS["test"], i, tr.video_cfg) for i in range(args.test_clips)]
        test.update(E.evaluate_video(final, tr.processor, clips))
    log("TEST " + " ".join(f"{k}={v:.3f}" for k, v in test.items()))
    status = f"finished at step {tr.step} of {args.steps}" if args.finish and args.steps else "finished"
    tr.export(out, test_acc=test, status=status)


def main(argv: list[str] | None = None) -> int:
    """Train; bad input (e.g. a fresh run over an earlier checkpoint) is one ``error:`` line and exit status 2."""
    from vtprune.cli import run_reporting_errors

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    return run_reporting_errors(lambda: run(args), "vtprune bench train")


if __name__ == "__main__":
    raise SystemExit(main())
