"""A pruned KV cache is refused by any model that no longer holds its conversation: after ``handle.remove()``,
after ``remove()`` and ``wrap()`` with another method, by a model never wrapped, and as a deep copy; the refusal
is one line, comes before the cache changes, and a cache nothing was pruned from still continues anywhere."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.errors import UserError
from vtprune.models.chat import _cache_keyword
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)
SUPPRESS = list(range(len(SPECIAL_TOKENS)))
CASES = [("llava", "prefixkv", {}), ("qwen2_vl", "random", {"layer": 0}), ("llava", "fastv", {})]
IDS = ["llava-prefixkv", "qwen2_vl-random@0", "llava-fastv"]


def _cache(output):
    return getattr(output, "cache", None) or output.past_key_values


def _turn1(model, processor, model_type: str, method: str, options: dict, keep: float = 0.4):
    """A wrapped model's first turn: its inputs, its output, its handle."""
    inputs = tiny_inputs(processor, model_type, two_samples(model_type)[:1])
    handle = vtprune.wrap(model, method, keep=keep, **options)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, suppress_tokens=SUPPRESS,
                             return_dict_in_generate=True)
    return inputs, out, handle


def _turn2(model, processor, inputs: dict, out, cache) -> dict:
    """generate() keywords of a follow-up turn that continues ``cache``."""
    follow = processor.tokenizer([" and the square?"], return_tensors="pt", add_special_tokens=False)["input_ids"]
    ids = torch.cat([out.sequences, follow], 1)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    if "mm_token_type_ids" in extra:
        types = extra["mm_token_type_ids"]
        extra["mm_token_type_ids"] = torch.cat([types, torch.zeros(1, ids.shape[1] - types.shape[1], dtype=types.dtype)], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), _cache_keyword(model): cache, **extra,
            "max_new_tokens": 2, "do_sample": False, "suppress_tokens": SUPPRESS}


def _snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _refused(model, processor, inputs, out, cache) -> None:
    """generate() and a plain forward continuing ``cache`` both raise the one-line refusal; the cache is unchanged."""
    before = _snapshot(cache)
    kwargs = _turn2(model, processor, inputs, out, cache)
    with torch.no_grad():
        with pytest.raises(UserError, match="start the conversation again") as error:
            model.generate(**kwargs)
        assert "\n" not in str(error.value)
        with pytest.raises(UserError, match="start the conversation again"):
            model(input_ids=out.sequences[:, -1:], **{_cache_keyword(model): cache})
    for (keys, values), layer in zip(before, cache.layers, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


@pytest.mark.parametrize(("model_type", "method", "options"), CASES, ids=IDS)
@pytest.mark.parametrize("after", ["remove", "rewrap", "never_wrapped"])
def test_a_pruned_cache_is_refused_by_a_model_that_no_longer_holds_its_call(model_type, method, options, after):
    """Before, continuing it ran without error and answered wrongly (turn-2 max |dlogit| 0.10 on LLaVA prefixkv,
    0.037 on Qwen2-VL random, keep 0.5), or fastv raised a raw shape error."""
    model, processor = tiny_model(model_type, "sdpa", image_size=112)
    inputs, out, handle = _turn1(model, processor, model_type, method, options)
    handle.remove()
    if after == "rewrap":
        vtprune.wrap(model, "pdrop", keep=0.5)
    elif after == "never_wrapped":
        model, _ = tiny_model(model_type, "sdpa", image_size=112)
    _refused(model, processor, inputs, out, _cache(out))


@pytest.mark.parametrize(("model_type", "method", "options"), CASES, ids=IDS)
def test_a_copy_of_a_pruned_cache_is_refused_and_the_original_continues(model_type, method, options):
    model, processor = tiny_model(model_type, "sdpa", image_size=112)
    inputs, out, handle = _turn1(model, processor, model_type, method, options)
    copied = copy.deepcopy(_cache(out))
    _refused(model, processor, inputs, out, copied)
    kwargs = _turn2(model, processor, inputs, out, _cache(out))
    with torch.no_grad():  # the wrapping still holds the original's conversation
        follow = model.generate(**kwargs)
    assert follow.shape[1] == kwargs["input_ids"].shape[1] + 2
    handle.remove()


def test_a_cache_nothing_was_pruned_from_continues_after_remove():
    """keep=1 leaves the cache as the unwrapped model's: it is not marked, and continues as the unwrapped one."""
    model, processor = tiny_model("llava", "sdpa", image_size=112)
    inputs, out, handle = _turn1(model, processor, "llava", "fastv", {}, keep=1.0)
    handle.remove()
    with torch.no_grad():
        plain = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False, suppress_tokens=SUPPRESS,
                               return_dict_in_generate=True)
        kept = model.generate(**_turn2(model, processor, inputs, out, _cache(out)))
        again = model.generate(**_turn2(model, processor, inputs, plain, _cache(plain)))
    assert torch.equal(kept, again)


def test_the_mark_keeps_nothing_alive():
    """The pruned cache's mark holds weak references: the cache is freed with its last reference (no cycle)."""
    model, processor = tiny_model("llava", "sdpa", image_size=112)
    _, out, handle = _turn1(model, processor, "llava", "fastv", {})
    cache = weakref.ref(_cache(out))
    assert "update" in vars(cache())  # marked
    del out
    assert cache() is None
    handle.remove()


def test_a_saved_pruned_cache_loads_pruned_and_refuses_to_grow(tmp_path):
    """``torch.save`` of a pruned cache used to raise a raw weakref pickling error; it saves, and the loaded cache
    holds the same entries and, like a deep copy, is refused in one line; the original continues."""
    model, processor = tiny_model("llava", "sdpa", image_size=112)
    inputs, out, handle = _turn1(model, processor, "llava", "fastv", {})
    torch.save(_cache(out), tmp_path / "cache.pt")
    loaded = torch.load(tmp_path / "cache.pt", weights_only=False)
    for (keys, values), layer in zip(_snapshot(_cache(out)), loaded.layers, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
    _refused(model, processor, inputs, out, loaded)
    with torch.no_grad():
        model.generate(**_turn2(model, processor, inputs, out, _cache(out)))
    handle.remove()
