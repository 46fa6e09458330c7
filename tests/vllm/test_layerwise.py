"""Layer-wise methods inside vLLM's language model, per family and method, against vtprune's transformers path.

Each engine runs with prefix caching on, chunked prefill in small chunks (a prompt's chunks are held until its last
one) and two sequences at a time, so new prefills join running decodes. Checked, for every request of a batch: at
keep 0.25 the kept visual tokens, the greedy tokens and the log-probabilities of six decode steps equal
``vtprune.wrap(model, method, keep=0.25)`` on the same weights; at keep 1.0 (per request) the pruned model equals
stock vLLM. Families: the embedded LLaVA-1.5 (every method) and Qwen2-VL (4 decoder layers), and tiny 4-layer
LLaVA-NeXT, LLaVA-OneVision, Qwen2.5-VL and Qwen3-VL checkpoints (tests/vllm/tiny_folders.py); see CASES. Two
cases run compiled (COMPILED), keep 1.0 included.
"""

from __future__ import annotations

import collections

import pytest
from conftest import shutdown
from layerwise_support import TOLERANCE, engine_steps, reference_steps, selections, step_gap

EVERY = ("fastv", "pdrop", "transprune", "ttv", "dart", "fastv+debias")
#: every method on LLaVA-1.5; on the other families a method each of the three kinds (last-token attention, capture
#: and instruction attention, key norms and hidden states), so every method runs on at least two families
CASES = ([("llava", m) for m in EVERY] + [("qwen2_vl", m) for m in ("fastv", "transprune", "dart")]
         + [("llava_next", "fastv"), ("llava_onevision", "transprune"), ("qwen2_5_vl", "pdrop+debias"),
            ("qwen3_vl", "dart"), ("qwen2_vl", "ttv")])  # Qwen3-VL: DeepStack feeds layers 0-1, stages from 2
#: cases whose engine keeps vLLM's compile mode (``enforce_eager`` off): M-RoPE positions, captures, DeepStack
COMPILED = {("qwen2_vl", "transprune"), ("qwen3_vl", "dart")}
ARCHITECTURE = {"llava": "Llava", "qwen2_vl": "Qwen2VL", "llava_next": "LlavaNext", "llava_onevision": "LlavaOnevision",
                "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
SIZES = [(112, 112), (200, 112), (112, 190)]  # width x height (LLaVA-NeXT / OneVision: several tile grids)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Family -> model folder (cached): the embedded models, or a tiny 4-layer checkpoint."""
    from tiny_folders import BUILDERS

    from vtprune.vllm.export import model_folder

    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = (model_folder(f"embedded:{family}") if family in ("llava", "qwen2_vl")
                             else str(BUILDERS[family](tmp_path_factory.mktemp(family), layers=4)))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def samples(items):
    """Three (image, question) pairs at three sizes, and a two-image prompt."""
    chosen = [(image.resize(size), question) for (image, question), size in zip(items, SIZES)]
    return chosen + [([chosen[1][0], chosen[2][0]], chosen[0][1])]


def start(folder: str, family: str, method: str | None, **options):
    """An in-process engine (stock when ``method`` is None), float32, eager, small and deterministic."""
    from vllm import LLM

    settings = dict(enforce_eager=True, dtype="float32", max_model_len=512, seed=0, limit_mm_per_prompt={"image": 2},
                    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=8,
                    max_num_seqs=2, block_size=32)
    if method is not None:
        settings["hf_overrides"] = {"architectures": [f"Vtprune{ARCHITECTURE[family]}ForConditionalGeneration"],
                                    "vtprune": {"method": method, "keep": 0.25}}
    settings.update(options)
    return LLM(folder, **settings)


@pytest.fixture(scope="session")
def stock(folders, samples):
    """Family -> stock vLLM's steps on the samples (one engine per family, once per session)."""
    cache: dict[str, list] = {}

    def get(family: str) -> list:
        if family not in cache:
            llm = start(folders(family), family, None)
            try:
                cache[family] = engine_steps(llm, samples)
            finally:
                shutdown(llm)
        return cache[family]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def case(request, folders, samples):
    """``(family, method, engine, reference)``: the pruned engine and the transformers path's steps at 0.25."""
    import reference

    family, method = request.param
    folder = folders(family)
    model, processor = reference.load_folder(folder)
    want = reference_steps(model, processor, samples, method, 0.25)
    llm = start(folder, family, method, **({"enforce_eager": False} if (family, method) in COMPILED else {}))
    yield family, method, llm, want
    shutdown(llm)


def test_pruned_requests_equal_the_transformers_path(case, samples):
    family, method, llm, want = case
    selections(llm)
    got = engine_steps(llm, samples)
    assert step_gap(got, want) < TOLERANCE
    assert collections.Counter(map(tuple, selections(llm))) == collections.Counter(tuple(k) for _, k, _ in want)


def test_keep_one_equals_stock_vllm(case, samples, stock):
    family, _, llm, _ = case
    got = engine_steps(llm, samples, keep=1.0)
    reference = stock(family)
    assert [ids for ids, _ in got] == [ids for ids, _ in reference]
    gaps = [abs(value - ref[token]) for (_, tops), (_, ref_tops) in zip(got, reference)
            for top, ref in zip(tops, ref_tops) for token, value in top.items()]
    assert max(gaps) < 1e-5
    assert selections(llm) == []  # nothing pruned
