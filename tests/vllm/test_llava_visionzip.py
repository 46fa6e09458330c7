"""VisionZip in vLLM on the embedded LLaVA: the tower's attention recomputed inside vLLM's CLIP layer, dominant +
contextual rows, compact positions; equal to vtprune's transformers path with positions="compact" (one engine)."""

from __future__ import annotations

import pytest
import reference
from conftest import assert_same_answers, generate, make_llm, selections, shutdown


@pytest.fixture(scope="module")
def expected(items):
    """vtprune's transformers path: visionzip at 0.25 (token ids, kept indices, first-step log-probabilities)."""
    model, processor = reference.load("llava")
    return {0.25: reference.answers(model, processor, items, "visionzip", 0.25, logprobs=True, positions="compact"),
            1.0: reference.answers(model, processor, items, None, 1.0)}


@pytest.fixture(scope="module")
def engine(expected):
    llm = make_llm("llava", method="visionzip")
    yield llm
    shutdown(llm)


def test_visionzip_equals_transformers_path(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, logprobs=5)
    assert selections(engine) == [row[1] for row in expected[0.25]]
    # the contextual row's merged value and the compact positions move the first step's log-probabilities
    assert_same_answers(got, expected[0.25])


def test_visionzip_keep_one_and_mixed_keeps(engine, items, expected):
    keeps = [1.0, 0.25] * (len(items) // 2)
    got = generate(engine, items, keeps=keeps)
    want = [expected[keep][i][0] for i, keep in enumerate(keeps)]
    assert [ids for ids, _, _ in got] == want
