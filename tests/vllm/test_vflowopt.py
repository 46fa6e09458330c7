"""VFlowOpt's pre-LLM stage in vLLM on the embedded LLaVA and Qwen2-VL: the tower's attention recomputed inside
vLLM's own tower layer (LLaVA: the CLIP layer the projector reads; Qwen2-VL: the last ViT block, per 2 x 2 merger
unit), context relevance at the release's threshold, top rows without recycling; equal to vtprune's transformers
path with ``schedule="0:keep", recycle=False`` (LLaVA: ``positions="compact"``; Qwen2-VL: original M-RoPE
positions), one engine per family. Qwen2-VL serves images only with it (video refused at start-up)."""

from __future__ import annotations

import pytest
import reference
from conftest import assert_same_answers, generate, make_llm, selections, shutdown

FAMILIES = {"llava": ({"recycle": False, "positions": "compact"}, {}),
            "qwen2_vl": ({"recycle": False}, {"limit_mm_per_prompt": {"image": 2, "video": 0}})}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def expected(family, items):
    """vtprune's transformers path at keep 0.25 and 0.5 (token ids, kept indices, first-step log-probabilities)."""
    model, processor = reference.load(family)
    return {keep: reference.answers(model, processor, items, "vflowopt", keep, logprobs=True, schedule=f"0:{keep}",
                                    **FAMILIES[family][0]) for keep in (0.25, 0.5)}


@pytest.fixture(scope="module")
def engine(family, expected):
    llm = make_llm(family, method="vflowopt", **FAMILIES[family][1])
    yield llm
    shutdown(llm)


def test_vflowopt_equals_transformers_path(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, logprobs=5)
    assert selections(engine) == [row[1] for row in expected[0.25]]
    assert_same_answers(got, expected[0.25])


def test_vflowopt_per_request_keep(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, keeps=[0.5] * len(items))
    assert selections(engine) == [row[1] for row in expected[0.5]]
    assert [ids for ids, _, _ in got] == [row[0] for row in expected[0.5]]


def test_vflowopt_with_video_refused_at_start(capfd):
    with pytest.raises(Exception) as error:
        make_llm("qwen2_vl", method="vflowopt")  # the default limits allow a video
    assert "scores images only" in str(error.value) + "".join(capfd.readouterr())
