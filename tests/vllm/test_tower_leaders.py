"""VisPruner, HiPrune and SCOPE in vLLM on the embedded LLaVA and Qwen2-VL, and on tiny Qwen2.5-VL / Qwen3-VL
checkpoints (tests/vllm/tiny_folders.py): the tower's attention recomputed inside vLLM's own tower (LLaVA: the CLIP
feature layer, VisPruner and SCOPE also its output features, HiPrune also its object layer; Qwen-VL: the last
full-attention ViT block per 2 x 2 merger unit, HiPrune also its object block; VisPruner's diverse rounds and SCOPE's
coverage on the LLM-input embeddings), each
image or temporal patch keeping ``keep_count(keep, n)`` rows; equal to vtprune's transformers path (same kept rows,
greedy tokens and first-step log-probabilities; LLaVA with ``positions="compact"``, Qwen-VL at original M-RoPE
positions; Qwen3-VL's kept rows keep their DeepStack features). One engine per case, alive one at a time.
The embedded models' images keep at most 8 tokens, too few for HiPrune's anchors (``round(k * 0.1 / 5)`` is 0), so
there HiPrune keeps the deep layer's top rows; the tiny folders' 448 px image at keep 0.5 keeps 32-41 and places one."""

from __future__ import annotations

import pytest
import reference
from conftest import assert_same_answers, generate, generate_video, make_llm, selections, shutdown

#: (family, method) -> the transformers path's options (the tiny Qwen2.5-VL / Qwen3-VL folders: tiny_folders.py)
CASES = {("llava", "vispruner"): {"positions": "compact"}, ("qwen2_vl", "vispruner"): {},
         ("llava", "hiprune"): {"positions": "compact"}, ("qwen2_vl", "hiprune"): {},
         ("qwen2_5_vl", "vispruner"): {}, ("qwen3_vl", "vispruner"): {},
         ("qwen2_5_vl", "hiprune"): {}, ("qwen3_vl", "hiprune"): {},
         ("llava", "scope"): {"positions": "compact"}, ("qwen2_vl", "scope"): {},
         ("qwen2_5_vl", "scope"): {}, ("qwen3_vl", "scope"): {}}
TINY = {"qwen2_5_vl": "VtpruneQwen2_5_VLForConditionalGeneration", "qwen3_vl": "VtpruneQwen3VLForConditionalGeneration"}
#: tiny folders: three sizes in one batch; the 448 px image (resized to the folder's 65,536-pixel limit) keeps 32-41
#: rows at keep 0.5, enough (>= 26) for one HiPrune anchor
SIZES = [(112, 112), (200, 112), (448, 448)]


@pytest.fixture(scope="module", params=list(CASES), ids=lambda case: "-".join(case))
def case(request):
    return request.param


@pytest.fixture(scope="module")
def folder(case, tmp_path_factory):
    """The embedded model's folder, or a tiny checkpoint built for the case."""
    from tiny_folders import BUILDERS

    from vtprune.vllm.export import model_folder

    family = case[0]
    return str(BUILDERS[family](tmp_path_factory.mktemp(family))) if family in TINY else model_folder(
        f"embedded:{family}")


@pytest.fixture(scope="module")
def samples(case, items):
    """The (image, question) pairs: the embedded split, or its first images resized (tiny folders)."""
    if case[0] not in TINY:
        return items
    return [(image.resize(size), question) for (image, question), size in zip(items, SIZES)]


@pytest.fixture(scope="module")
def expected(case, folder, samples):
    """vtprune's transformers path at keep 0.25 and 0.5 (token ids, kept indices, first-step log-probabilities)."""
    family, method = case
    model, processor = reference.load_folder(folder) if family in TINY else reference.load(family)
    return {keep: reference.answers(model, processor, samples, method, keep, logprobs=True, **CASES[case])
            for keep in (0.25, 0.5)}


@pytest.fixture(scope="module")
def engine(case, folder, expected):
    family, method = case
    if family not in TINY:
        llm = make_llm(family, method=method)
    else:  # prefill chunks of 3 tokens: an image's kept rows span several chunks
        from vllm import LLM

        llm = LLM(folder, enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, max_num_seqs=3,
                  enable_chunked_prefill=True, max_num_batched_tokens=3, block_size=32,
                  limit_mm_per_prompt={"image": 1, "video": 0},
                  hf_overrides={"architectures": [TINY[family]], "vtprune": {"method": method, "keep": 0.25}})
    yield llm
    shutdown(llm)


def kept(engine, case) -> list[list[int]]:
    """The plugin's kept rows since the last clear (tiny folders: sorted, their chunked batch runs the tower in any
    order)."""
    rows = selections(engine)
    return sorted(rows) if case[0] in TINY else rows


def want(rows, case) -> list[list[int]]:
    return sorted(rows) if case[0] in TINY else rows


def test_equals_transformers_path(engine, case, samples, expected):
    selections(engine, clear=True)
    got = generate(engine, samples, logprobs=5)
    assert kept(engine, case) == want([row[1] for row in expected[0.25]], case)
    assert_same_answers(got, expected[0.25])


def test_per_request_keep(engine, case, samples, expected):
    keeps = [(0.5, 0.25)[i % 2] for i in range(len(samples))]
    selections(engine, clear=True)
    got = generate(engine, samples, keeps=keeps)
    assert kept(engine, case) == want([expected[keep][i][1] for i, keep in enumerate(keeps)], case)
    assert [ids for ids, _, _ in got] == [expected[keep][i][0] for i, keep in enumerate(keeps)]
    if case[0] in TINY:  # at 0.5 the 448 px image keeps enough rows for a HiPrune anchor and its buffer cross
        from vtprune.methods.hiprune import RELEASED_ALPHA, anchor_count

        assert anchor_count(len(expected[0.5][2][1]), RELEASED_ALPHA) >= 1


@pytest.mark.parametrize("case", [case for case in CASES if case[0] == "qwen2_vl"], indirect=True,
                         ids=lambda case: "-".join(case))
def test_video_per_temporal_patch(engine, case, clip):
    """Qwen2-VL video: every temporal patch keeps its own share, as vtprune's per-frame groups. Run on the embedded
    Qwen2-VL's cases only: LLaVA-1.5 has no video input, and the tiny Qwen2.5-VL / Qwen3-VL folders run the same
    per-frame path (their engines take no video)."""
    frames, question = clip
    model, processor = reference.load("qwen2_vl")
    want_ids, want_kept = reference.video_answers(model, processor, frames, question, case[1], 0.25)
    selections(engine, clear=True)
    assert generate_video(engine, frames, question) == want_ids
    assert selections(engine) == [want_kept]
