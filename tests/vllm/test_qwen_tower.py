"""VisionZip and VFlowOpt's pre-LLM stage on Qwen2.5-VL and Qwen3-VL in vLLM (tiny checkpoints,
tests/vllm/tiny_folders.py): the last full-attention ViT block's attention recomputed inside vLLM's tower
(``Qwen2_5_VisionAttention``'s fused ``qkv``), original M-RoPE positions; equal to vtprune's transformers path at
its pre-LLM stage. Qwen2.5-VL: the scored block sees the merged tokens in window order (put back in token order).
Qwen3-VL: kept rows keep their DeepStack features, and VisionZip's contextual tokens merge the LLM-input embedding,
each keeping its target's DeepStack rows (as ``Adapter.prune_lm_inputs`` slices them). One engine per family and
method, images of three sizes in one batch, prefill chunks of 3 tokens."""

from __future__ import annotations

import pytest
import reference
from conftest import shutdown

TOLERANCE = 1e-3
METHODS = {"visionzip": {}, "vflowopt": {"schedule": "0:0.25", "recycle": False}}
SIZES = [(112, 112), (200, 112), (112, 190)]


ARCHITECTURES = {"qwen2_5_vl": "VtpruneQwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "VtpruneQwen3VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    from tiny_folders import BUILDERS

    return str(BUILDERS[family](tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="module")
def samples(items):
    return [(image.resize(size), question) for (image, question), size in zip(items, SIZES)]


@pytest.fixture(scope="module", params=list(METHODS))
def method(request):
    return request.param


@pytest.fixture(scope="module")
def expected(folder, samples, method):
    model, processor = reference.load_folder(folder)
    return reference.answers(model, processor, samples, method, 0.25, logprobs=True, **METHODS[method])


@pytest.fixture(scope="module")
def engine(family, folder, method, expected):
    from vllm import LLM

    llm = LLM(folder, enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, max_num_seqs=3,
              enable_chunked_prefill=True, max_num_batched_tokens=3, block_size=32,
              limit_mm_per_prompt={"image": 1, "video": 0},
              hf_overrides={"architectures": [ARCHITECTURES[family]],
                            "vtprune": {"method": method, "keep": 0.25}})
    yield llm
    shutdown(llm)


def test_tower_method_equals_transformers_path(engine, samples, expected):
    from vllm import SamplingParams

    from vtprune.vllm.common import clear_selections, recent_selections

    engine.apply_model(clear_selections)
    requests = [{"prompt": reference.prompt(engine.get_tokenizer(), question), "multi_modal_data": {"image": image}}
                for image, question in samples]
    outputs = engine.generate(requests, SamplingParams(max_tokens=4, temperature=0.0, logprobs=5), use_tqdm=False)
    assert sorted(engine.apply_model(recent_selections)[0]) == sorted(kept for _, kept, _ in expected)
    for out, (ids, _, reference_logprobs) in zip(outputs, expected):
        assert list(out.outputs[0].token_ids) == ids
        top = {t: p.logprob for t, p in out.outputs[0].logprobs[0].items()}
        assert max(abs(value - reference_logprobs[token]) for token, value in top.items()) < TOLERANCE
