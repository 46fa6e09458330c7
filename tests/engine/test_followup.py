"""Follow-up turns on a pruned cache (a second question about the same image, no new image): the turn continues
from turn 1's cache with correct masks and positions, equal to the independent reference (LLaVA and Qwen; a
left-padded batch of 2 and batch 1 with an all-ones mask or none, which generate() drops; in-LM stages, pre-LLM
stages and KV retention; tiny and embedded models), and query-agnostic methods answer the same with reuse and
reprefill."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import two_samples
from independent_reference import reference_decode, reference_decode_kv

import vtprune
from vtprune.models.chat import _cache_keyword
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)


def _cache(output):
    """The cache of a generate() output (``cache`` since transformers 5.24, ``past_key_values`` before)."""
    return getattr(output, "cache", None) or output.past_key_values
SUPPRESS = list(range(len(SPECIAL_TOKENS)))
TURN1, TURN2 = 3, 3


@functools.cache
def _model(model_type: str):
    return tiny_model(model_type, "sdpa", image_size=112)


def _samples(model_type: str) -> list:
    return two_samples(model_type)


def _extend(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([tensor, torch.zeros(tensor.shape[0], width - tensor.shape[1], dtype=tensor.dtype)], 1)


def _check_followup(model_type: str, method: str, options: dict, rows: int, mask: str) -> None:
    """Turn 1 (generate), then turn 2 continuing its cache with the whole conversation as ``input_ids`` and the
    2-D mask ``mask``: ``"padded"`` (turn 1's mask, extended), ``"ones"`` (all ones, which generate() drops) or
    ``"absent"`` (none; generate() derives it from the pad tokens); each row equals the independent reference."""
    model, processor = _model(model_type)
    samples = _samples(model_type)[:rows]
    inputs = tiny_inputs(processor, model_type, samples)
    follow = processor.tokenizer([" and the square?"] * rows, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad(), vtprune.apply(model, method, keep=0.4, **options) as handle:
        turn1 = model.generate(**inputs, max_new_tokens=TURN1, min_new_tokens=TURN1, do_sample=False,
                               suppress_tokens=SUPPRESS, return_dict_in_generate=True)
        kept, stages = handle.last_stats.kept_indices, [s.layer for s in handle.stages]
        ids = torch.cat([turn1.sequences, follow["input_ids"]], 1)
        full_mask = torch.cat([inputs["attention_mask"], torch.ones(rows, TURN1, dtype=torch.long),
                               follow["attention_mask"]], 1)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
        if "mm_token_type_ids" in extra:
            extra["mm_token_type_ids"] = _extend(extra["mm_token_type_ids"], ids.shape[1])
        if mask != "absent":
            extra["attention_mask"] = full_mask if mask == "padded" else torch.ones_like(ids)
        extra[_cache_keyword(model)] = _cache(turn1)
        turn2 = model.generate(input_ids=ids, do_sample=False, max_new_tokens=TURN2,
                               min_new_tokens=TURN2, suppress_tokens=SUPPRESS, output_logits=True,
                               return_dict_in_generate=True, **extra)
    logits = torch.stack(turn2.logits, 1)
    for row, sample in enumerate(samples):
        alone = tiny_inputs(processor, model_type, [sample])
        valid = full_mask[row].bool()
        conversation = {**alone, "input_ids": ids[row:row + 1, valid],
                        "attention_mask": torch.ones(1, int(valid.sum()), dtype=torch.long)}
        if "mm_token_type_ids" in alone:
            conversation["mm_token_type_ids"] = _extend(alone["mm_token_type_ids"], conversation["input_ids"].shape[1])
        kept_row = [stage[row] for stage in kept]
        if method == "prefixkv":  # the turn-1 prompt was prefilled whole; later tokens see each layer's kept keys
            tokens, ref = reference_decode_kv(model, conversation, kept_row, TURN2, len(SPECIAL_TOKENS),
                                              prompt=alone["input_ids"].shape[1])
        else:
            tokens, ref = reference_decode(model, conversation, stages, kept_row, TURN2, len(SPECIAL_TOKENS),
                                           compact=options.get("positions") == "compact")
        assert torch.equal(tokens, turn2.sequences[row, ids.shape[1]:])
        torch.testing.assert_close(ref, logits[row], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mask", ["padded", "absent"])
@pytest.mark.parametrize(("model_type", "method", "options"), [
    ("llava", "pdrop", {}), ("qwen2_5_vl", "fastv", {}), ("llava", "random", {"layer": 0}),
    ("qwen2_vl", "random", {"layer": 0}), ("llava", "prefixkv", {}), ("qwen2_5_vl", "prefixkv", {}),
    ("llava", "divprune", {}), ("qwen2_vl", "divprune", {}),
    ("llava", "cdpruner", {}), ("qwen2_vl", "mmtok", {}), ("qwen2_5_vl", "vispruner", {}), ("llava", "hiprune", {}),
    ("llava", "random", {"schedule": "0:0.5,2:0.25", "positions": "compact"}),
])
def test_followup_turn_of_a_ragged_batch_equals_the_reference(model_type, method, options, mask):
    _check_followup(model_type, method, options, rows=2, mask=mask)


@pytest.mark.parametrize("mask", ["ones", "absent"])
@pytest.mark.parametrize(("model_type", "method", "options"), [
    (model_type, method, options) for model_type in ("llava", "qwen2_vl")
    for method, options in (("random", {"schedule": "0:0.5"}), ("divprune", {}), ("prefixkv", {}), ("fastv", {}))
] + [("llava", "random", {"schedule": "0:0.5", "positions": "compact"})])
def test_followup_turn_without_padding_equals_the_reference(model_type, method, options, mask):
    """Batch 1 with an all-ones mask or none: generate() drops the mask and feeds the tokens beyond the pruned
    layer-0 cache, some of which the cache has seen; the engine feeds the language model only the new ones."""
    _check_followup(model_type, method, options, rows=1, mask=mask)


def _conversation(model, processor, inputs: dict, question: str) -> tuple:
    """Turn 1 of one conversation (generate), and a function running its turn 2 on its cache (the turn's logits)."""
    turn1 = model.generate(**inputs, max_new_tokens=TURN1, min_new_tokens=TURN1, do_sample=False,
                           suppress_tokens=SUPPRESS, return_dict_in_generate=True)

    def turn2() -> torch.Tensor:
        follow = processor.tokenizer([question], return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = torch.cat([turn1.sequences, follow], 1)
        extra = {"mm_token_type_ids": _extend(inputs["mm_token_type_ids"], ids.shape[1]),
                 "image_grid_thw": inputs["image_grid_thw"], _cache_keyword(model): _cache(turn1)}
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TURN2,
                             min_new_tokens=TURN2, do_sample=False, suppress_tokens=SUPPRESS, output_logits=True,
                             return_dict_in_generate=True, **extra)
        return torch.stack(out.logits, 1)

    return turn1, turn2


@pytest.mark.parametrize(("model_type", "method", "options"), [
    ("qwen2_vl", "random", {"layer": 0}), ("qwen2_vl", "fastv", {}), ("qwen2_vl", "prefixkv", {}),
    ("qwen2_5_vl", "divprune", {}), ("qwen2_vl", "none", {}),
])
def test_qwen_followups_after_another_conversation_equal_each_run_alone(model_type, method, options):
    """Turn 1 of A, turn 1 of B (another image size: other M-RoPE deltas), then turn 2 of A and of B on one wrapped
    model: each equals its conversation run alone. transformers keeps one ``rope_deltas`` per model instance (the
    last prefill's), so A's turn 2 continued from B's (max |dlogit| 0.0026 here, the unwrapped model alike)."""
    model, processor = _model(model_type)
    inputs = [tiny_inputs(processor, model_type, [sample]) for sample in _samples(model_type)]
    questions = [" and the square?", " and the circle?"]
    with torch.no_grad(), vtprune.apply(model, method, keep=0.5, **options):
        alone = []
        for x, question in zip(inputs, questions, strict=True):
            _, turn2 = _conversation(model, processor, x, question)
            alone.append(turn2())
        turns, deltas = [], []
        for x, question in zip(inputs, questions, strict=True):
            turns.append(_conversation(model, processor, x, question)[1])
            deltas.append(model.model.rope_deltas.clone())  # what transformers keeps after each prefill
        interleaved = [turn2() for turn2 in turns]
    assert not torch.equal(*deltas)  # else the order could not matter
    for got, want in zip(interleaved, alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_qwen_followup_keeps_its_positions_while_another_thread_prefills():
    """generate() reads the model's rope_deltas before its first forward: the generate guard holds the model's lock
    until then, so another thread's prefill (which writes them) cannot slip in. Thread 1's follow-up is paused
    there (up to 2 s) while thread 2 starts a prefill; without the lock thread 1 read thread 2's deltas."""
    import threading

    model, processor = _model("qwen2_vl")
    a, b = (tiny_inputs(processor, "qwen2_vl", [sample]) for sample in _samples("qwen2_vl"))
    with torch.no_grad(), vtprune.apply(model, "random", keep=0.5, layer=0):
        want_a = _conversation(model, processor, a, " and the square?")[1]()
        want_b = _conversation(model, processor, b, " and the circle?")[1]()
        turn2 = _conversation(model, processor, a, " and the square?")[1]
        original = model._prepare_position_ids_for_generation
        paused, other_done, got = threading.Event(), threading.Event(), {}

        def pausing(*args, **kwargs):
            if threading.current_thread().name == "followup" and not paused.is_set():
                paused.set()
                other_done.wait(timeout=2.0)
            return original(*args, **kwargs)

        def other() -> None:
            paused.wait(timeout=120.0)
            got["b"] = _conversation(model, processor, b, " and the circle?")[1]()
            other_done.set()

        model._prepare_position_ids_for_generation = pausing  # this instance only; deleted below
        try:
            threads = [threading.Thread(target=lambda: got.setdefault("a", turn2()), name="followup"),
                       threading.Thread(target=other)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300.0)
        finally:
            del model._prepare_position_ids_for_generation
    torch.testing.assert_close(got["a"], want_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["b"], want_b, atol=1e-5, rtol=0)


def test_a_followup_with_a_new_image_is_refused():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    with torch.no_grad(), vtprune.apply(model, "fastv", keep=0.5):
        out = model.generate(**inputs, max_new_tokens=2, return_dict_in_generate=True)
        with pytest.raises(RuntimeError, match="adds images to a non-empty cache"):
            model(**inputs, past_key_values=_cache(out))


@pytest.mark.parametrize("spec", ["embedded:llava", "embedded:qwen2_vl"])
def test_chat_reuse_equals_reprefill_without_pruning_and_differs_only_by_pruning(spec):
    import warnings

    from vtprune.models.chat import chat
    from vtprune.models.loading import load
    from vtprune.shapes.task import make_split

    model, processor = load(spec, device="cpu")
    sample = make_split("test", 3)[2]
    questions = [q.text for q in sample.questions[:3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the cache is reused: no re-tokenization fallback
        assert chat(model, processor, sample.image, questions, "reuse") == \
            chat(model, processor, sample.image, questions, "reprefill")
    with pytest.raises(ValueError, match="followup="):
        chat(model, processor, sample.image, questions, "sometimes")


def _at_keep(options: dict, keep: float) -> dict:
    """``options`` with ``{keep}`` in a schedule filled in."""
    return {k: v.format(keep=keep) if isinstance(v, str) else v for k, v in options.items()}


# keep=0.25 on the embedded Qwen2-VL: the pruned layer-0 cache (18 entries) ends inside the image (tokens 3-18),
# which generate() took for a new image, resetting rope_deltas (turn 2 off by up to 2.8 in logits); keep=0.5
# (22 entries) passed by luck.
@pytest.mark.parametrize("keep", [0.5, 0.25])
@pytest.mark.parametrize("spec", ["embedded:llava", "embedded:qwen2_vl"])
@pytest.mark.parametrize(("method", "options"), [("random", {"schedule": "0:{keep}"}), ("divprune", {}),
                                                 ("visionzip", {})])
def test_chat_reuse_equals_reprefill_for_query_agnostic_methods(spec, method, options, keep):
    """docs/methods.md: a query-agnostic pre-LLM method keeps the same tokens whichever question is asked, so
    continuing turn 1's pruned cache (reuse) answers exactly as re-running the conversation (reprefill)."""
    import warnings

    from vtprune.models.chat import chat
    from vtprune.models.loading import load
    from vtprune.shapes.task import make_split

    model, processor = load(spec, device="cpu")
    sample = make_split("test", 3)[2]
    questions = [q.text for q in sample.questions[:3]]
    with vtprune.apply(model, method, keep=keep, **_at_keep(options, keep)), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the cache is reused: no re-tokenization fallback
        assert chat(model, processor, sample.image, questions, "reuse", max_new_tokens=12) == \
            chat(model, processor, sample.image, questions, "reprefill", max_new_tokens=12)


@pytest.mark.parametrize("keep", [0.5, 0.25])
@pytest.mark.parametrize("spec", ["embedded:llava", "embedded:qwen2_vl"])
@pytest.mark.parametrize(("method", "options"), [("random", {"schedule": "0:{keep}"}), ("divprune", {}),
                                                 ("prefixkv", {})])
def test_chat_followup_turn_on_an_embedded_model_equals_the_reference(spec, method, options, keep):
    """What ``chat(followup="reuse")`` runs: turn 2 continues turn 1's cache with the re-tokenized conversation
    and an all-ones mask (which generate() drops); its logits equal the independent reference."""
    from vtprune.models.chat import _messages
    from vtprune.models.loading import load
    from vtprune.shapes.task import make_split

    model, processor = load(spec, device="cpu")
    suppress = model.generation_config.eos_token_id + 1  # the reference never picks ids below it
    sample = make_split("test", 3)[2]
    questions = [q.text for q in sample.questions[:2]]

    def encode(answers: list[str]) -> dict:
        text = processor.apply_chat_template(_messages(questions[:len(answers) + 1], answers), add_generation_prompt=True)
        return dict(processor(text=[text], images=[sample.image], return_tensors="pt"))

    with torch.no_grad(), vtprune.apply(model, method, keep=keep, **_at_keep(options, keep)) as handle:
        first = encode([])
        turn1 = model.generate(**first, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        kept, stages = [k[0] for k in handle.last_stats.kept_indices], [s.layer for s in handle.stages]
        answer = processor.tokenizer.decode(turn1.sequences[0, first["input_ids"].shape[1]:], skip_special_tokens=True)
        second = encode([answer.strip()])
        ids = second["input_ids"]
        assert torch.equal(ids[:, :turn1.sequences.shape[1]], turn1.sequences)
        extra = {k: v for k, v in second.items() if k == "mm_token_type_ids"}
        extra[_cache_keyword(model)] = _cache(turn1)
        turn2 = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=TURN2,
                               min_new_tokens=TURN2, do_sample=False, suppress_tokens=list(range(suppress)),
                               output_logits=True, return_dict_in_generate=True, **extra)
    conversation = {**second, "attention_mask": torch.ones_like(ids)}
    if method == "prefixkv":
        tokens, ref = reference_decode_kv(model, conversation, kept, TURN2, suppress, prompt=first["input_ids"].shape[1])
    else:
        tokens, ref = reference_decode(model, conversation, stages, kept, TURN2, suppress)
    assert torch.equal(tokens, turn2.sequences[0, ids.shape[1]:])
    torch.testing.assert_close(ref, torch.stack(turn2.logits, 1)[0], atol=1e-4, rtol=0)
