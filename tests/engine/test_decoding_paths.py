"""Decoding paths a pruned cache cannot keep exact are refused at the call in one line (``use_cache=False``,
static caches, prompt-lookup / assisted decoding); a forward without a cache records no pruning it did not do;
an interrupt (any ``BaseException``) inside a forward releases the model for the other threads."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from cases import two_samples
from transformers import DynamicCache, StaticCache

import vtprune
from vtprune.errors import UserError
from vtprune.models.chat import _cache_keyword
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)
SUPPRESS = list(range(len(SPECIAL_TOKENS)))
METHODS = [("fastv", {}), ("prefixkv", {}), ("random", {"layer": 0})]


@functools.cache
def _model(model_type: str = "llava"):
    return tiny_model(model_type, "sdpa", image_size=112)


def _inputs(rows: int = 1) -> dict:
    _, processor = _model()
    return tiny_inputs(processor, "llava", two_samples("llava")[:rows])


def _generate(model, inputs: dict, steps: int = 4, **options) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             suppress_tokens=SUPPRESS, output_logits=True, return_dict_in_generate=True, **options)
    return out.sequences[:, -steps:], torch.stack(out.logits, dim=1)


def _hooks(model) -> list:
    return [(name, kind, list(getattr(module, kind).values())) for name, module in model.named_modules()
            for kind in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")]


@pytest.mark.parametrize(("method", "options"), METHODS)
@pytest.mark.parametrize(("generate_options", "message"), [
    ({"use_cache": False}, r"generate\(use_cache=False\) is not supported"),
    ({"cache_implementation": "static"}, r"generate\(cache_implementation='static'\) is not supported"),
    ({"prompt_lookup_num_tokens": 3}, r"prompt-lookup decoding \(prompt_lookup_num_tokens=3\) is not supported"),
])
def test_unsupported_decoding_paths_are_refused_at_the_call(method, options, generate_options, message):
    model, _ = _model()
    inputs = _inputs()
    with vtprune.apply(model, method, keep=0.4, **options) as handle:
        expected = _generate(model, inputs)
        with pytest.raises(UserError, match=message) as error:
            _generate(model, inputs, **generate_options)
        assert "\n" not in str(error.value) and "handle.remove()" in str(error.value)
        assert not handle.calls.frames
        after = _generate(model, inputs)  # the model is still usable, with the same result
    assert torch.equal(after[0], expected[0])
    torch.testing.assert_close(after[1], expected[1], atol=0, rtol=0)


@pytest.mark.parametrize(("method", "options"), METHODS)
def test_a_static_cache_object_is_refused_in_generate_and_in_a_forward(method, options):
    model, _ = _model()
    inputs = _inputs()
    with vtprune.apply(model, method, keep=0.4, **options), torch.no_grad():
        with pytest.raises(UserError, match="cannot prune into a StaticCache"):
            model.generate(**inputs, max_new_tokens=2, past_key_values=StaticCache(config=model.config,
                                                                                    max_cache_len=256))
        with pytest.raises(UserError, match="cannot prune into a StaticCache"):
            model(**inputs, past_key_values=StaticCache(config=model.config, max_cache_len=256))
        with pytest.raises(UserError, match="cannot prune into an offloaded DynamicCache"):
            model(**inputs, past_key_values=DynamicCache(config=model.config, offloading=True))
        model(**inputs, past_key_values=DynamicCache(config=model.config))  # the default kind is fine


def test_assisted_decoding_and_a_followup_with_prompt_lookup_are_refused():
    model, processor = _model()
    assistant, _ = tiny_model("llava", "sdpa", image_size=112)
    inputs = _inputs()
    with vtprune.apply(model, "fastv", keep=0.4), torch.no_grad():
        with pytest.raises(UserError, match=r"assisted decoding \(assistant_model=...\) is not supported"):
            model.generate(**inputs, max_new_tokens=3, assistant_model=assistant)
        turn1 = model.generate(**inputs, max_new_tokens=2, return_dict_in_generate=True)
        follow = processor.tokenizer([" and the square?"], return_tensors="pt", add_special_tokens=False)
        ids = torch.cat([turn1.sequences, follow["input_ids"]], 1)
        with pytest.raises(UserError, match="prompt_lookup_num_tokens"):
            model.generate(input_ids=ids, max_new_tokens=3, prompt_lookup_num_tokens=2,
                           **{_cache_keyword(model): getattr(turn1, "cache", None) or turn1.past_key_values})


def test_text_only_generate_is_not_refused():
    """Nothing is pruned without images: every decoding path runs as on the unwrapped model."""
    model, processor = _model()
    text = processor.tokenizer(["what color is the circle"], return_tensors="pt")
    expected = _generate(model, text, use_cache=False)
    with vtprune.apply(model, "fastv", keep=0.4):
        got = _generate(model, text, use_cache=False)
        looked_up = _generate(model, text, prompt_lookup_num_tokens=2)
    assert torch.equal(got[0], expected[0]) and torch.equal(looked_up[0], expected[0])


def test_a_forward_without_cache_prunes_as_the_cached_prefill_and_records_only_what_it_did():
    model, _ = _model()
    inputs = _inputs(rows=2)
    with torch.no_grad():
        unwrapped = model(**inputs).logits
        with vtprune.apply(model, "fastv", keep=0.4) as handle:
            cached = model(**inputs).logits
            uncached = model(**inputs, use_cache=False).logits
            assert len(handle.stats) == 2 and handle.stats[0].kept == handle.stats[1].kept
        with vtprune.apply(model, "prefixkv", keep=0.4) as handle:
            uncached_kv = model(**inputs, use_cache=False).logits
            assert len(handle.stats) == 0 and handle.last_stats is None  # no cache: nothing was evicted
            model(**inputs)
            assert len(handle.stats) == 1 and handle.last_stats.retained_kv
        with vtprune.apply(model, "none", keep=1.0) as handle:
            model(**inputs)  # the baseline of a comparison records its call: every visual token kept
            stats = handle.last_stats
            assert len(handle.stats) == 1 and not stats.stage_layers and sum(stats.visual_tokens) > 0
    torch.testing.assert_close(uncached, cached, atol=0, rtol=0, equal_nan=True)
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(uncached_kv[valid], unwrapped[valid], atol=1e-5, rtol=0)


def test_an_interrupt_inside_a_forward_releases_the_model_for_other_threads():
    model, _ = _model()
    lm = model.model.language_model
    request = _inputs()
    pristine, attributes = _hooks(model), set(model.__dict__)
    expected = _generate(model, request)
    hidden = torch.randn(1, 5, model.config.text_config.hidden_size)
    position = lm.rotary_emb(hidden, torch.arange(5)[None])
    with torch.no_grad():
        layer_alone = lm.layers[2](hidden, attention_mask=None, position_embeddings=position)
    handle = vtprune.wrap(model, "fastv", keep=0.4)  # layer 2 is a stage layer: hooked
    wrapped = _generate(model, request)
    inside, go = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def tripwire(module, args):
        if threading.current_thread() is first and not inside.is_set():
            inside.set()
            go.wait(10)
            raise KeyboardInterrupt

    def interrupted() -> None:
        try:
            _generate(model, request)
        except KeyboardInterrupt:
            results["interrupted"] = True
        results["open_frames"] = len(handle.calls.frames)
        with torch.no_grad():  # a decoder layer called directly on this thread: not hooked by the dead call
            results["layer"] = lm.layers[2](hidden, attention_mask=None, position_embeddings=position)

    wire = lm.layers[1].register_forward_pre_hook(tripwire)
    first = threading.Thread(target=interrupted, daemon=True)
    second = threading.Thread(target=lambda: results.setdefault("second", _generate(model, request)), daemon=True)
    try:
        first.start()
        assert inside.wait(10)
        second.start()
        time.sleep(0.3)  # the second thread now waits for the model's lock
        go.set()
        first.join(10)
        second.join(10)
        assert not first.is_alive() and not second.is_alive(), "a thread is still blocked after 10 s"
    finally:
        wire.remove()
        go.set()
    assert results["interrupted"] and results["open_frames"] == 0
    assert torch.equal(results["second"][0], wrapped[0])
    torch.testing.assert_close(results["second"][1], wrapped[1], atol=1e-6, rtol=0, equal_nan=True)
    torch.testing.assert_close(results["layer"], layer_alone, atol=0, rtol=0)
    handle.remove()
    assert _hooks(model) == pristine and set(model.__dict__) == attributes
    again = _generate(model, request)
    assert torch.equal(again[0], expected[0])
    torch.testing.assert_close(again[1], expected[1], atol=0, rtol=0)


def test_an_interrupt_inside_the_model_pre_hook_releases_the_lock(monkeypatch):
    model, _ = _model()
    inputs = _inputs()
    with vtprune.apply(model, "fastv", keep=0.4) as handle, torch.no_grad():
        expected = model(**inputs).logits

        def interrupt(ids):
            raise KeyboardInterrupt

        monkeypatch.setattr(handle.adapter, "visual_mask", interrupt)  # raised after the frame and lock are taken
        with pytest.raises(KeyboardInterrupt):
            model(**inputs)
        monkeypatch.undo()
        assert not handle.calls.frames
        got = {}
        other = threading.Thread(target=lambda: got.setdefault("logits", model(**inputs).logits), daemon=True)
        other.start()
        other.join(10)
        assert not other.is_alive(), "the model lock is still held"
    torch.testing.assert_close(got["logits"], expected, atol=0, rtol=0, equal_nan=True)
