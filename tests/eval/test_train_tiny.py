"""The embedded-model training recipe: data helpers, loss weights, and a seeded two-step run per architecture."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vtprune.eval.training import models as M  # noqa: E402
from vtprune.eval.training import qwen as Q  # noqa: E402
from vtprune.eval.training import train as T  # noqa: E402

from vtprune.shapes import task as S  # noqa: E402
from vtprune.shapes import video as V  # noqa: E402


def test_tokenizer_is_whole_word_and_spells_numbers() -> None:
    tok = M.build_tokenizer()
    ids = tok("What color is the triangle ?", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6 and tok.unk_token_id not in ids
    digits = tok(" 352", add_special_tokens=False)["input_ids"]
    assert len(digits) == 3 and tok.decode(digits) == "352"


def test_training_questions_bind_colour_and_shape() -> None:
    for index in range(20):
        sample = S.generate_image_sample(S.SPLIT_SEEDS["train"], index)
        qs = M.training_questions(sample, np.random.default_rng(index))
        texts = [q.text for q in qs]
        assert len(texts) == len(set(texts)) and len(qs) <= max(M.MAX_TURNS, len(sample.questions))
        assert {q.text for q in sample.questions} <= set(texts)  # every base question survives the cap
        for q in qs:
            if q.qtype == "color":
                shape = q.text.split()[-1].rstrip("?")
                matches = [o for o in sample.shapes if o.shape == shape]
                assert len(matches) == 1 and matches[0].color == q.answer
            if q.qtype == "shape":
                color = q.text.split()[4]
                matches = [o for o in sample.shapes if o.color == color]
                assert len(matches) == 1 and matches[0].shape == q.answer
            if q.qtype == "where":
                color, shape = q.text.split()[3], q.text.split()[4].rstrip("?")
                matches = [o for o in sample.shapes if (o.color, o.shape) == (color, shape)]
                assert len(matches) == 1 and matches[0].quadrant == q.answer
            if q.qtype == "count":
                plural = q.text.split()[2]
                shape = next(s for s, p in S.PLURALS.items() if p == plural)
                assert q.answer == str(sum(o.shape == shape for o in sample.shapes))
    kinds = collections.Counter(q.qtype for i in range(20) for q in M.training_questions(
        S.generate_image_sample(S.SPLIT_SEEDS["train"], i), np.random.default_rng(i)))
    assert kinds["where"] > 20 and kinds["count"] > 20  # extras beyond the one base question per image


def test_answer_weights_give_each_answer_weight_one() -> None:
    labels = torch.tensor([[-100, 5, 6, 7, -100, -100, 9, -100], [-100, -100, 4, -100, 8, 8, -100, -100]])
    w = M.answer_weights(labels)
    expected = torch.tensor([[0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 1, 0], [0, 0, 1, 0, 0.5, 0.5, 0, 0]])
    assert torch.allclose(w, expected)


def test_patch_labels_hand_case() -> None:
    red_square = S.SceneObject(box=(0, 0, 14, 14), quadrant="top-left", shape="square", color="red")
    digit = S.SceneObject(box=(28, 14, 42, 28), quadrant="top-right", digit="7")
    labels = M.patch_labels([red_square, digit], grid=4)
    assert labels["color"].tolist()[:4] == [S.COLORS.index("red") + 1, 0, 0, 0]
    assert labels["shape"][0] == S.SHAPES.index("square") + 1
    assert labels["digit"][1 * 4 + 2] == 8 and labels["digit"].sum() == 8
    assert labels["quadrant"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]


def test_digit_slots_hand_case() -> None:
    """Digits centred in a patch fill its slots left to right; other patches stay empty."""
    three = S.SceneObject(box=(30, 2, 36, 12), quadrant="top-right", digit="3")
    one = S.SceneObject(box=(40, 2, 46, 12), quadrant="top-right", digit="1")
    eight = S.SceneObject(box=(60, 2, 66, 12), quadrant="top-right", digit="8")
    slots = M.digit_slots([eight, one, three], grid=4, patch=28)  # given out of order on purpose
    assert slots.shape == (16, M.DIGIT_SLOTS)
    assert slots[1].tolist() == [4, 2, 0] and slots[2].tolist() == [9, 0, 0]
    assert slots.sum() == 4 + 2 + 9
    assert (M.patch_labels([three, one, eight], grid=4, patch=28)["digits"] == slots).all()


def test_resume_grows_optimizer_state_for_new_heads() -> None:
    """Moments of the old parameters carry over when a head is appended; the new one starts empty."""
    a, b, c = (torch.nn.Parameter(torch.ones(2, 2)) for _ in range(3))
    old_opt = torch.optim.AdamW([{"params": [a, b]}], lr=0.1)
    (a.sum() + 2 * b.sum()).backward()
    old_opt.step()
    new_opt = torch.optim.AdamW([{"params": [a, b, c]}], lr=0.1)
    new_opt.load_state_dict(T.grow_optimizer_state(old_opt.state_dict(), new_opt.state_dict()))
    assert torch.equal(new_opt.state[b]["exp_avg"], old_opt.state[b]["exp_avg"]) and c not in new_opt.state


def test_training_frames_control_evidence() -> None:
    clip = V.generate_video_sample(S.SPLIT_SEEDS["train"], 3)
    q = clip.questions[0]
    for seed in range(20):
        with_ev = Q.training_frames(clip, q, np.random.default_rng(seed), p_evidence=1.0)
        without = Q.training_frames(clip, q, np.random.default_rng(seed), p_evidence=0.0)
        assert with_ev == sorted(set(with_ev)) and 2 <= len(with_ev) <= 12
        assert set(with_ev) & set(q.frames) and not set(without) & set(q.frames)


def test_packed_mask_and_positions_hand_case() -> None:
    segments = torch.tensor([[0, 0, 1, 1, 2, 2, 2, -1]])
    mask = M.packed_attention(segments)[0, 0]
    assert mask[3].tolist() == [True, True, True, True, False, False, False, False]
    assert mask[6].tolist() == [True, True, False, False, True, True, True, False]
    assert mask[7].tolist() == [True, True] + [False] * 5 + [True]  # padding: prefix and itself, never NaN
    assert M.packed_positions(segments)[0].tolist() == [0, 1, 2, 3, 2, 3, 4, 0]


def test_packed_turns_equal_single_turn_prompts() -> None:
    """Every packed turn's logits equal the model run on that question alone (LLaVA and Qwen2-VL)."""
    torch.manual_seed(0)
    sample = S.generate_image_sample(S.SPLIT_SEEDS["val"], 1)
    tok = M.build_tokenizer()
    llava, batcher = M.build_llava(tok).eval(), M.LlavaBatcher(tok, 112)
    qs = M.training_questions(sample, np.random.default_rng(0))
    batch = batcher([sample], np.random.default_rng(0))
    ids, _, seg = batcher.conversation(qs)
    seg = torch.tensor(seg)
    with torch.no_grad():
        packed = llava(**batch["inputs"]).logits[0]
        for turn in (1, len(qs)):
            keep = (seg == 0) | (seg == turn)
            alone = llava(input_ids=torch.tensor(ids)[keep][None], pixel_values=batch["inputs"]["pixel_values"])
            torch.testing.assert_close(packed[keep], alone.logits[0], atol=1e-5, rtol=0)
    qtok = Q.build_qwen_tokenizer()
    processor = Q.build_qwen_processor(qtok, 112)
    qwen, qbatcher = Q.build_qwen2vl(qtok).eval(), Q.QwenBatcher(processor, 112)
    batch = qbatcher([sample], np.random.default_rng(0))
    seg = batch["segments"][0]
    with torch.no_grad():
        packed = qwen(**Q.packed_inputs(qwen, batch)).logits[0]
        for turn in (1, len(qs)):
            q = qs[turn - 1]
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q.text}]},
                    {"role": "assistant", "content": [{"type": "text", "text": q.answer}]}]
            enc = processor(images=[sample.image], text=[processor.apply_chat_template(msgs)], return_tensors="pt")
            keep = (seg == 0) | (seg == turn)
            assert enc["input_ids"][0].tolist() == batch["inputs"]["input_ids"][0][keep].tolist()
            torch.testing.assert_close(packed[keep], qwen(**enc).logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("patch", [14, 28])
def test_llava_batches_match_the_shipped_processor(patch: int) -> None:
    tok = M.build_tokenizer()
    processor = M.build_llava_processor(tok, 112, patch)
    batcher = M.LlavaBatcher(tok, 112, patch)
    M.check_consistency(processor, batcher, S.ShapesConfig())
    sample = S.generate_image_sample(S.SPLIT_SEEDS["val"], 0)
    batch = batcher([sample], np.random.default_rng(0))
    grid = 112 // patch
    assert (batch["inputs"]["input_ids"] == batcher.image_id).sum() == grid * grid
    assert batch["aux"]["color"].shape == (1, grid * grid)
    model = M.build_llava(tok, 112, patch_size=patch).eval()
    with torch.no_grad():
        model(**batch["inputs"])  # the image-token count matches the tower's patch grid


def test_qwen_video_batch_asks_each_question_as_letters_and_open_ended() -> None:
    from vtprune.shapes.video import open_form

    processor = Q.build_qwen_processor(Q.build_qwen_tokenizer(), 112)
    clip = V.generate_video_sample(S.SPLIT_SEEDS["train"], 0)
    batch = Q.QwenVideoBatcher(processor)([clip], np.random.default_rng(0))
    tok = processor.tokenizer
    answers = [tok.convert_ids_to_tokens(row[labels != -100].tolist())
               for row, labels in zip(batch["inputs"]["input_ids"], batch["labels"], strict=True)]
    expected = []
    for q in clip.questions:
        expected += [[q.answer, "<|im_end|>"], [open_form(q)[1], "<|im_end|>"]]
    assert answers == expected
    frames = (batch["inputs"]["image_grid_thw"].prod(dim=-1) // 4).tolist()
    assert set(frames) == {16}  # 112 px frames stay at 16 tokens


def _tiny_run(tmp_path, name: str, extra: list[str]) -> dict[str, torch.Tensor]:
    out = tmp_path / name
    args = T.parse_args(["--steps", "2", "--batch", "2", "--warmup", "1", "--val-images", "1", "--test-images", "1",
                         "--out", str(out), "--workdir", str(tmp_path / f"{name}-work"), *extra])
    T.run(args)
    assert (out / "config.json").is_file() and (out / "README.md").is_file()
    from safetensors.torch import load_file

    return load_file(next(out.glob("*.safetensors")))


def test_llava_training_is_seeded_and_exports_a_loadable_model(tmp_path) -> None:
    first = _tiny_run(tmp_path, "a", [])
    second = _tiny_run(tmp_path, "b", [])
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    LlavaForConditionalGeneration.from_pretrained(tmp_path / "a")
    AutoProcessor.from_pretrained(tmp_path / "a")


def test_qwen_training_with_video_runs_and_exports(tmp_path) -> None:
    weights = _tiny_run(tmp_path, "q", ["--arch", "qwen2_vl", "--image-size", "112", "--video-clips", "1",
                                        "--val-clips", "1", "--test-clips", "1"])
    assert any("visual" in k for k in weights)
    from transformers import Qwen2VLForConditionalGeneration

    Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "q")
    processor = Q.load_qwen_processor(tmp_path / "q")
    assert processor.image_processor.size["shortest_edge"] == 56 * 56
