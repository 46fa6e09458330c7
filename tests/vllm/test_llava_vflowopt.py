"""VFlowOpt's pre-LLM stage in vLLM on the embedded LLaVA: the tower's attention recomputed inside vLLM's CLIP
layer, context relevance at the release's threshold, top rows without recycling, compact positions; equal to
vtprune's transformers path with ``schedule="0:0.25", recycle=False, positions="compact"`` (one engine)."""

from __future__ import annotations

import pytest
import reference
from conftest import generate, make_llm, selections, shutdown

TOLERANCE = 1e-3  # float32 log-probabilities, vLLM's CPU kernels against transformers' SDPA
OPTIONS = {"recycle": False, "positions": "compact"}


@pytest.fixture(scope="module")
def expected(items):
    """vtprune's transformers path at keep 0.25 and 0.5 (token ids, kept indices, first-step log-probabilities)."""
    model, processor = reference.load("llava")
    return {keep: reference.answers(model, processor, items, "vflowopt", keep, logprobs=True, schedule=f"0:{keep}",
                                    **OPTIONS) for keep in (0.25, 0.5)}


@pytest.fixture(scope="module")
def engine(expected):
    llm = make_llm("llava", method="vflowopt")
    yield llm
    shutdown(llm)


def test_vflowopt_equals_transformers_path(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, logprobs=5)
    assert selections(engine) == [row[1] for row in expected[0.25]]
    assert [row[0] for row in got] == [row[0] for row in expected[0.25]]
    for (_, _, _, top), (_, _, reference_logprobs) in zip(got, expected[0.25]):
        assert max(abs(value - reference_logprobs[token]) for token, value in top.items()) < TOLERANCE


def test_vflowopt_per_request_keep(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, keeps=[0.5] * len(items))
    assert selections(engine) == [row[1] for row in expected[0.5]]
    assert [ids for ids, _, _ in got] == [row[0] for row in expected[0.5]]
