"""VisionZip in vLLM on the embedded Qwen2-VL: the last ViT block's attention recomputed inside vLLM's tower, dominant +
contextual rows at their original M-RoPE positions; equal to vtprune's transformers path (one engine)."""

from __future__ import annotations

import pytest
import reference
from conftest import assert_same_answers, generate, generate_video, make_llm, selections, shutdown


@pytest.fixture(scope="module")
def expected(items):
    """vtprune's transformers path: visionzip at 0.25 (token ids, kept indices, first-step log-probabilities)."""
    model, processor = reference.load("qwen2_vl")
    return reference.answers(model, processor, items, "visionzip", 0.25, logprobs=True)


@pytest.fixture(scope="module")
def engine(expected):
    llm = make_llm("qwen2_vl", method="visionzip")
    yield llm
    shutdown(llm)


def test_visionzip_equals_transformers_path(engine, items, expected):
    selections(engine, clear=True)
    got = generate(engine, items, logprobs=5)
    assert selections(engine) == [row[1] for row in expected]
    assert_same_answers(got, expected)


def test_visionzip_video_equals_transformers_path(engine, clip):
    """A video: every temporal patch keeps its own share, dominant + contextual, as vtprune's per-frame groups."""
    frames, question = clip
    model, processor = reference.load("qwen2_vl")
    want_ids, want_kept = reference.video_answers(model, processor, frames, question, "visionzip", 0.25)
    selections(engine, clear=True)
    assert generate_video(engine, frames, question) == want_ids
    assert selections(engine) == [want_kept]
