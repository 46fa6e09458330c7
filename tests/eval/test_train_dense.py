"""Training the 64-token LLaVA on the dense task: tokenizer, per-patch targets, questions, legs and resume."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vtprune.eval.training import dense as TD  # noqa: E402
from vtprune.eval.training import models as M  # noqa: E402
from vtprune.eval.training import train as T  # noqa: E402

from vtprune.models.embedded import embedded_model_path  # noqa: E402
from vtprune.shapes import dense as D  # noqa: E402
from vtprune.shapes import task as S  # noqa: E402


def test_dense_tokenizer_extends_the_shipped_vocabulary() -> None:
    """The first version's tokenizer still equals the shipped LLaVA's; the dense one only appends words."""
    shipped = json.loads((embedded_model_path("llava") / "tokenizer.json").read_text())["model"]["vocab"]
    assert M.build_tokenizer().get_vocab() == shipped
    dense = TD.build_dense_tokenizer()
    assert all(dense.get_vocab()[w] == i for w, i in shipped.items())
    for q in ("Where exactly is the red circle ?", *D.CELLS):
        assert dense.unk_token_id not in dense(q, add_special_tokens=False)["input_ids"]


def test_dense_patch_labels_hand_case() -> None:
    """Shapes label their patches with colour/shape/cell; digits with their value and place in the number."""
    square = S.SceneObject(box=(0, 0, 28, 28), quadrant="top-left", shape="square", color="blue")
    seven = S.SceneObject(box=(90, 60, 104, 82), quadrant="top", digit="7")  # patch (2, 3)
    two = S.SceneObject(box=(62, 58, 76, 80), quadrant="top", digit="2")  # patch (2, 2), leftmost
    labels = TD.dense_patch_labels([seven, square, two], grid=8, patch=28)
    assert labels["color"][0] == S.COLORS.index("blue") + 1 and labels["color"].sum() == labels["color"][0]
    assert labels["shape"][0] == S.SHAPES.index("square") + 1 and labels["cell"][0] == 1
    assert labels["digit"][2 * 8 + 2] == 3 and labels["digit"][2 * 8 + 3] == 8
    assert labels["place"].tolist().count(0) == 62 and labels["place"][2 * 8 + 2] == 1 and labels["place"][2 * 8 + 3] == 2


def test_dense_labels_agree_with_the_read_answer() -> None:
    """On generated scenes, the digits at places 1, 2, 3 spell the answer to the read question."""
    for index in range(10):
        s = D.generate_dense_sample(S.SPLIT_SEEDS["train"], index)
        labels = TD.dense_patch_labels(s.objects, 8, 28)
        order = np.argsort(np.where(labels["place"] > 0, labels["place"], 99))[: len(s.number)]
        assert "".join(str(labels["digit"][i] - 1) for i in order) == s.number


def test_dense_training_questions_answer_from_the_scene() -> None:
    for index in range(15):
        s = D.generate_dense_sample(S.SPLIT_SEEDS["train"], index)
        qs = TD.dense_training_questions(s, np.random.default_rng(index))
        assert {q.text for q in s.questions} <= {q.text for q in qs} and len(qs) <= TD.DENSE_MAX_TURNS
        assert len({q.text for q in qs}) == len(qs)
        for q in qs:
            if q.qtype == "where3":
                col, shp = q.text[:-1].split()[-2:]
                (o,) = [o for o in s.shapes if (o.color, o.shape) == (col, shp)]
                assert q.answer == o.quadrant == D.cell_of(o.box, 224)
            if q.qtype == "count":
                plural = q.text.split()[2]
                assert q.answer == str(sum(S.PLURALS[o.shape] == plural for o in s.shapes))
            if q.qtype == "color":
                (o,) = [o for o in s.shapes if o.shape == q.text.split()[-1].rstrip("?")]
                assert q.answer == o.color


def test_dense_batches_match_the_processor() -> None:
    """Packed dense turns equal the processor's single-turn prompts, with 64 image tokens per image."""
    args = T.parse_args(["--task", "dense", "--steps", "1"])
    parts = TD.build_dense_parts(args)
    sample = D.generate_dense_sample(S.SPLIT_SEEDS["val"], 0)
    M.check_consistency(parts["processor"], parts["batcher"], parts["cfg"], sample)
    batch = parts["batcher"]([sample], np.random.default_rng(0))
    assert (batch["inputs"]["input_ids"] == parts["batcher"].image_id).sum() == 64
    assert set(batch["aux"]) == set(TD.DENSE_AUX_HEADS) and batch["aux"]["place"].shape == (1, 64)
    assert parts["data"].difficulty(0) == 0.0 and parts["data"].difficulty(args.curriculum_steps) == 1.0


def _args(tmp_path, *extra: str) -> list[str]:
    return ["--task", "dense", "--steps", "3", "--batch", "2", "--warmup", "1", "--val-images", "1",
            "--test-images", "1", "--vision-width", "32", "--text-width", "32", "--layers", "1",
            "--curriculum-steps", "2", *extra]


def test_training_legs_resume_to_the_same_weights(tmp_path) -> None:
    """Stopping after one step (--leg-minutes) and resuming gives exactly the uninterrupted run's weights."""
    T.run(T.parse_args(_args(tmp_path, "--workdir", str(tmp_path / "straight"))))
    legs = tmp_path / "legs"
    T.run(T.parse_args(_args(tmp_path, "--workdir", str(legs), "--leg-minutes", "1e-9")))
    first = torch.load(legs / "ckpt.pt", weights_only=False)
    assert first["step"] == 1 and first["curve"][-1]["step"] == 1 and "opt" in first
    T.run(T.parse_args(_args(tmp_path, "--workdir", str(legs), "--resume")))
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=False)
    b = torch.load(legs / "ckpt.pt", weights_only=False)
    assert a["step"] == b["step"] == 3
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(a["aux"][k], b["aux"][k]) for k in a["aux"])
    assert (legs / "export" / "learning_curve.png").is_file() and (legs / "learning_curve.csv").is_file()


def test_compact_checkpoint_resumes_in_a_fresh_workdir(tmp_path) -> None:
    """The git checkpoint (bf16 moments, fp16 best) restarts a run elsewhere at its step, with its curve."""
    work = tmp_path / "w"
    T.run(T.parse_args(_args(tmp_path, "--workdir", str(work), "--leg-minutes", "1e-9")))
    size = TD.compact_checkpoint(work / "ckpt.pt", tmp_path / "git" / "ckpt.pt")
    full = torch.load(work / "ckpt.pt", weights_only=False)
    small = torch.load(tmp_path / "git" / "ckpt.pt", weights_only=False)
    assert size < (work / "ckpt.pt").stat().st_size
    assert all(torch.equal(full["model"][k], small["model"][k]) for k in full["model"])
    assert {v["exp_avg"].dtype for v in small["opt"]["state"].values()} == {torch.bfloat16}
    fresh = tmp_path / "fresh"
    T.run(T.parse_args(_args(tmp_path, "--workdir", str(fresh), "--resume-from", str(tmp_path / "git" / "ckpt.pt"))))
    done = torch.load(fresh / "ckpt.pt", weights_only=False)
    assert done["step"] == 3 and [r["step"] for r in done["curve"]][:1] == [1]
    assert {v["exp_avg"].dtype for v in done["opt"]["state"].values()} == {torch.float32}


def test_dense_defaults_write_under_runs(tmp_path, monkeypatch) -> None:
    """Without --workdir/--out the dense run writes to runs/llava64 (never into the shipped models)."""
    monkeypatch.chdir(tmp_path)
    T.run(T.parse_args(_args(tmp_path)))
    assert (tmp_path / "runs" / "llava64" / "ckpt.pt").is_file()
    assert (tmp_path / "runs" / "llava64" / "export" / "config.json").is_file()
    assert json.loads((tmp_path / "runs" / "llava64" / "export" / "config.json").read_text())[
        "vision_config"]["image_size"] == 224


def test_warm_start_from_the_16_token_model() -> None:
    """Weights carry over from the shipped 16-token LLaVA; its 4x4 position grid is resized to 8x8 bilinearly."""
    from transformers import LlavaForConditionalGeneration
    from vtprune.eval.training import evaluate as E

    old = LlavaForConditionalGeneration.from_pretrained(embedded_model_path("llava")).state_dict()
    parts = TD.build_dense_parts(T.parse_args(["--task", "dense", "--steps", "1"]))
    TD.warm_start(parts["model"], embedded_model_path("llava"))
    new = parts["model"].state_dict()
    key = "model.vision_tower.embeddings.position_embedding.weight"
    g_old, g_new = old[key][1:].reshape(4, 4, -1), new[key][1:].reshape(8, 8, -1)
    assert torch.equal(new[key][0], old[key][0]) and torch.allclose(g_new[0, 0], g_old[0, 0])
    assert torch.allclose(g_new[7, 7], g_old[3, 3])
    assert torch.allclose(g_new[1, 0], 0.75 * g_old[0, 0] + 0.25 * g_old[1, 0], atol=1e-6)  # row 1 samples y = 0.25
    emb = "model.language_model.embed_tokens.weight"
    assert torch.equal(new[emb][: old[emb].shape[0]], old[emb])
    assert all(torch.equal(new[k], v) for k, v in old.items() if k in new and new[k].shape == v.shape)
    acc = E.evaluate(parts["model"].eval(), parts["processor"], D.make_dense_split("val", 10), batch_size=64)
    assert (acc["color"] + acc["shape"]) / 2 >= 0.6, acc  # it already reads colours and shapes on 224 px scenes


def test_balanced_aux_loss_weighs_labelled_patches_like_the_background() -> None:
    """Balanced: (mean CE over labelled patches + mean CE over background patches) / 2, per head."""
    torch.manual_seed(0)
    head = M.AuxHead(8, {"digit": 11}, {}, balanced=True)
    feats = torch.randn(2, 5, 8)
    labels = {"digit": torch.tensor([[0, 0, 0, 0, 4], [0, 0, 7, 0, 0]])}
    logits = head.heads["digit"](feats).reshape(-1, 11).detach()
    ce = [float(torch.nn.functional.cross_entropy(logits[i:i + 1], labels["digit"].flatten()[i:i + 1]))
          for i in range(10)]
    fg = [4, 7]
    expected = 0.5 * np.mean([ce[i] for i in fg]) + 0.5 * np.mean([c for i, c in enumerate(ce) if i not in fg])
    assert abs(float(head(feats, labels).detach()) - expected) < 1e-5
    plain = M.AuxHead(8, {"digit": 11}, {})
    plain.load_state_dict(head.state_dict())
    assert abs(float(plain(feats, labels).detach()) - np.mean(ce)) < 1e-5


def test_number_answers_can_be_upweighted() -> None:
    """Answers of 3+ label tokens (numbers) get ``factor`` times their weight; word answers keep theirs."""
    labels = torch.tensor([[-100, 5, 2, -100, 7, 8, 9, 2, -100, 6, 6, 2]])
    w = M.answer_weights(labels)
    up = TD.upweight_long_answers(labels, w, 3.0)
    assert torch.allclose(up[0, 1:3], w[0, 1:3]) and torch.allclose(up[0, 4:8], 3 * w[0, 4:8])
    assert torch.allclose(up[0, 9:], 3 * w[0, 9:]) and torch.allclose(up[0, 4:8].sum(), torch.tensor(3.0))


def test_digit_readout_scores_the_lm_output_at_digit_tokens_only() -> None:
    """The loss reads the logits at the image-token positions, in patch order, and only where a digit is."""
    tok = TD.build_dense_tokenizer()
    readout = TD.DigitReadout(tok)
    image = tok.convert_tokens_to_ids("<image>")
    ids = torch.tensor([[1, image, image, image, 7], [1, image, image, image, 7]])  # 3 patches per image
    labels = torch.tensor([[0, 5, 0], [0, 0, 10]])  # digit 4 on patch 1 of image 0, digit 9 on patch 2 of image 1
    logits = torch.zeros(2, 5, len(tok))
    logits[0, 2, tok.convert_tokens_to_ids("4")] = 3.0  # patch 1 of image 0 is at sequence position 2
    logits[1, 3, tok.convert_tokens_to_ids("1")] = 3.0  # the wrong digit, on patch 2 of image 1
    logits[0, 1, tok.convert_tokens_to_ids("7")] = 50.0  # a background patch: ignored
    v = len(tok)
    right = -torch.log_softmax(torch.tensor([3.0] + [0.0] * (v - 1)), 0)[0]
    wrong = -torch.log_softmax(torch.tensor([3.0] + [0.0] * (v - 1)), 0)[1]
    assert torch.allclose(readout.loss(ids, logits, labels), (right + wrong) / 2)
