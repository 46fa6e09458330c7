"""The embedded Qwen2-VL in vLLM with the plugin: original M-RoPE positions, equal to vtprune's default."""

import pytest
import reference
from conftest import generate, generate_video, make_llm, selections, shutdown
from families import FamilyChecks


class TestQwen2VL(FamilyChecks):
    family = "qwen2_vl"
    options = {}
    chunk = 3  # the first chunk ends right after <|vision_start|> (vLLM's EVS position helper fails there)

    def test_video(self, engine, clip):
        """divprune keeps each temporal patch's own quarter, as vtprune's transformers path does on a video."""
        frames, question = clip
        model, processor = reference.load(self.family)
        want_ids, want_kept = reference.video_answers(model, processor, frames, question, "divprune", 0.25)
        selections(engine, clear=True)
        assert generate_video(engine, frames, question) == want_ids
        assert selections(engine) == [want_kept]


@pytest.fixture(scope="module")
def temporal_engine():
    llm = make_llm("qwen2_vl", method="temporal", keep=0.5)
    yield llm
    shutdown(llm)


def test_temporal_video_equals_transformers_path(temporal_engine, clip, items):
    """temporal keeps half of the whole video (the first patch first), vtprune's rule; images stay whole."""
    frames, question = clip
    model, processor = reference.load("qwen2_vl")
    want_ids, want_kept = reference.video_answers(model, processor, frames, question, "temporal", 0.5)
    selections(temporal_engine, clear=True)
    assert generate_video(temporal_engine, frames, question) == want_ids
    assert selections(temporal_engine) == [want_kept]
    assert len(want_kept) == 32 and want_kept[:16] == list(range(16))  # 32 of 64 rows, the first patch whole
    (_, length, _), = generate(temporal_engine, items[:1])
    assert selections(temporal_engine)[-1] == list(range(16))  # an image has no previous frame: kept whole
