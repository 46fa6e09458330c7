"""The engine under serving use: batches with pre-LLM stages, interleaved requests, threads, memory, faults."""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import threading
import weakref

import pytest
import torch
from cases import two_samples
from transformers import LogitsProcessor, LogitsProcessorList

import vtprune
from vtprune.models.tiny import SPECIAL_TOKENS, tiny_inputs, tiny_model

torch.set_num_threads(1)


@functools.cache
def _model(model_type: str, impl: str = "sdpa"):
    return tiny_model(model_type, impl, image_size=112)


def _samples(model_type: str) -> list:
    return two_samples(model_type)


def _generate(model, inputs, steps=4, processors=None):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             suppress_tokens=list(range(len(SPECIAL_TOKENS))), output_logits=True,
                             return_dict_in_generate=True, logits_processor=processors)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


@pytest.mark.parametrize(("model_type", "method", "options"), [
    ("qwen2_vl", "random", {"layer": 0, "seed": 3}),
    ("llava", "random", {"schedule": "0:0.5", "seed": 1}),
    ("qwen2_5_vl", "random", {"layer": 0}),
])
def test_pre_llm_batch_equals_samples_alone(model_type, method, options):
    """A pre-LLM-only schedule registers no decoder-layer hook; batched decoding must still be exact."""
    model, processor = _model(model_type)
    samples = _samples(model_type)
    with vtprune.apply(model, method, keep=0.5, **options) as handle:
        batch_tokens, batch_logits = _generate(model, tiny_inputs(processor, model_type, samples))
        batch_kept = handle.last_stats.kept_indices
        for row, sample in enumerate(samples):
            tokens, logits = _generate(model, tiny_inputs(processor, model_type, [sample]))
            assert handle.last_stats.kept_indices[0][0] == batch_kept[0][row]
            torch.testing.assert_close(batch_logits[row], logits[0], atol=1e-4, rtol=0)
            assert torch.equal(batch_tokens[row], tokens[0])


class RunInside(LogitsProcessor):
    """Runs ``job`` once, after the first decode step of the generate call it is attached to."""

    def __init__(self, job) -> None:
        self.job, self.calls = job, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 2:
            self.job()
        return scores


@pytest.mark.parametrize(("model_type", "method"), [("llava", "fastv"), ("qwen2_vl", "pdrop"), ("llava", "transprune"),
                                                    ("qwen2_vl", "random")])
def test_interleaved_requests_equal_sequential(model_type, method):
    """Prefill A (a ragged batch), decode A once, then a whole request B, then the rest of A: as if run alone."""
    model, processor = _model(model_type)
    samples = _samples(model_type)
    a, b = tiny_inputs(processor, model_type, samples), tiny_inputs(processor, model_type, samples[1:])
    options = {"layer": 0} if method == "random" else {}
    with vtprune.apply(model, method, keep=0.4, **options):
        alone_a, alone_b = _generate(model, a, steps=5), _generate(model, b, steps=5)
        inner = {}
        job = RunInside(lambda: inner.setdefault("b", _generate(model, b, steps=5)))
        outer_a = _generate(model, a, steps=5, processors=LogitsProcessorList([job]))
    for (tokens, logits), (ref_tokens, ref_logits) in ((outer_a, alone_a), (inner["b"], alone_b)):
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_threads_equal_sequential(model_type):
    """Two threads generating on one wrapped model, and a third running text-only forwards, change nothing."""
    model, processor = _model(model_type)
    requests = [tiny_inputs(processor, model_type, [s]) for s in _samples(model_type)]
    text_only = processor.tokenizer(["hello there"], return_tensors="pt")
    with vtprune.apply(model, "pdrop", keep=0.3) as handle:
        expected = [_generate(model, r, steps=6) for r in requests]
        results: dict[int, list] = {0: [], 1: []}
        errors: list[BaseException] = []
        stop = threading.Event()

        def serve(index: int) -> None:
            try:
                for _ in range(3):
                    results[index].append(_generate(model, requests[index], steps=6))
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        def chatter() -> None:
            with torch.no_grad():
                while not stop.is_set():
                    model(**text_only)

        threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 1)] + [threading.Thread(target=chatter)]
        for thread in threads:
            thread.start()
        for thread in threads[:2]:
            thread.join()
        stop.set()
        threads[2].join()
        assert not errors, errors
        assert handle.calls.live_calls() == 0
    for index in (0, 1):
        for tokens, logits in results[index]:
            assert torch.equal(tokens, expected[index][0])
            torch.testing.assert_close(logits, expected[index][1], atol=1e-5, rtol=0)


def _tensor_bytes(root: object, skip: tuple[object, ...]) -> int:
    """Bytes of every tensor reachable from ``root`` without passing through ``skip`` (the model)."""
    seen, stack, total = {id(s) for s in skip}, [root], 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, torch.nn.Module)):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
            continue
        stack.extend(gc.get_referents(item))
    return total


@pytest.mark.parametrize(("model_type", "method"), [("llava", "transprune"), ("llava", "vflowopt"),
                                                    ("qwen2_vl", "pdrop")])
def test_nothing_of_a_call_outlives_it(model_type, method):
    model, processor = _model(model_type)
    seen_caches: list[weakref.ref] = []

    def spy(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            seen_caches.append(weakref.ref(cache))

    spy_hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        with vtprune.apply(model, method, keep=0.4) as handle:
            inputs = tiny_inputs(processor, model_type, _samples(model_type))
            inputs_length = [inputs["input_ids"].shape[1]]
            pixels = weakref.ref(inputs["pixel_values"])
            _generate(model, inputs, steps=3)
            del inputs
            gc.collect()
            assert pixels() is None
            assert seen_caches and all(ref() is None for ref in seen_caches)
            assert handle.calls.live_calls() == 0
            # Until read, the newest calls' stats hold their kept ordinals ([B, L_s] longs per stage), nothing else.
            assert 0 < _tensor_bytes(handle, skip=(model,)) <= 3 * 2 * inputs_length[0] * 8
            assert handle.last_stats.kept_indices  # read from the device on first access
            assert _tensor_bytes(handle, skip=(model,)) == 0
    finally:
        spy_hook.remove()


def test_stats_stay_small():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    with torch.no_grad(), vtprune.apply(model, "fastv", keep=0.5, record_indices=2) as handle:
        for _ in range(5):
            model(**inputs)
    stats = list(handle.stats)
    assert len(stats) == 5
    assert [s.kept_indices is None for s in stats] == [True, True, True, False, False]
    assert all(s.kept == stats[-1].kept and s.forward_ms > 0 for s in stats)


def test_no_scoring_work_while_decoding(monkeypatch):
    import vtprune.methods.transprune as transprune
    from vtprune.methods.fastv import FastV

    counts = {"ttv": 0, "score": 0}
    terms = transprune.ttv_terms
    monkeypatch.setattr(transprune, "ttv_terms", lambda *a: counts.__setitem__("ttv", counts["ttv"] + 1) or terms(*a))
    score = FastV.score
    monkeypatch.setattr(FastV, "score", lambda self, *a: counts.__setitem__("score", counts["score"] + 1) or score(self, *a))
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    for method, key in (("ttv", "ttv"), ("fastv", "score")):
        with vtprune.apply(model, method, keep=0.5):
            _generate(model, inputs, steps=1)
            prefill_only = counts[key]
            _generate(model, inputs, steps=8)
        assert counts[key] == 2 * prefill_only > 0


def test_deepcopy_and_pickle_refuse_clearly():
    model, _ = tiny_model("llava")
    with vtprune.apply(model, "fastv", keep=0.5):
        with pytest.raises(TypeError, match="copy the model first and wrap the copy"):
            copy.deepcopy(model)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(model)
    clone = copy.deepcopy(model)  # after remove(): a plain model
    assert not hasattr(clone, "_vtprune_handle")


def test_training_mode_runs_unpruned_with_a_warning():
    model, processor = _model("llava")
    inputs = tiny_inputs(processor, "llava", _samples("llava")[:1])
    model.train()
    try:
        with torch.no_grad():
            reference = model(**inputs).logits
            with vtprune.apply(model, "fastv", keep=0.25) as handle, pytest.warns(UserWarning, match="training mode"):
                pruned = model(**inputs).logits
    finally:
        model.eval()
    torch.testing.assert_close(pruned, reference, atol=0, rtol=0)
    assert handle.last_stats is None


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_no_host_sync_in_decode_hooks(model_type):
    """Zero host-device syncs inside the hooks in every decode step; a few per prefill, not per layer."""
    from vtprune.eval.speed.syncs import count_syncs, watch_hooks

    model, processor = _model(model_type)
    inputs = tiny_inputs(processor, model_type, _samples(model_type))
    cases = [("fastv", {}), ("pdrop", {}), ("ttv", {}), ("transprune", {}), ("random", {"layer": 0}),
             ("per_frame", {}), ("oracle", {}), ("none", {}), ("prefixkv", {}), ("prefixkv", {"scope": "prompt"}),
             ("visionzip", {}), ("divprune", {}), ("dart", {})]  # these three: a few reads per image at prefill
    if model_type == "llava":
        cases += [("vflowopt", {}), ("pdrop", {"positions": "compact"})]
    for method, options in cases:
        with torch.no_grad(), vtprune.apply(model, method, keep=0.4, **options) as handle, \
                watch_hooks(handle) as hooks, count_syncs(only=hooks.inside, group=hooks.phase) as syncs:
            if method == "oracle":
                handle.set_evidence([torch.rand(200), torch.rand(200)])
            model.generate(**inputs, max_new_tokens=6, do_sample=False)
        assert hooks.forwards["decode"] == 5
        assert sum(syncs.by_group.get("decode", {}).values()) == 0, (method, syncs.by_group["decode"])
        if method in ("fastv", "pdrop", "ttv", "transprune", "random", "none", "prefixkv", "vflowopt"):
            # One read per prefill (lengths, padding side, visual counts); TransPrune +1 (instruction width);
            # PrefixKV +2 (its priorities to the host for the budget search, the per-layer counts back), +1
            # with scope="prompt" (the visual tokens left in each layer's cache, for the statistics).
            # VFlowOpt +1 (the counts after its recycling merge, at the one stage that merges).
            budget = {"transprune": 2, "vflowopt": 2, "prefixkv": 3 + (options.get("scope") == "prompt")}.get(method, 1)
            assert sum(syncs.by_group["prefill"].values()) <= budget, (method, syncs.by_group["prefill"])
