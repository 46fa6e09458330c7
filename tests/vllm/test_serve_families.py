"""``vtprune serve`` refuses, before vLLM starts, what the plugin's processors refuse at start-up: its family lists
(:data:`vtprune.vllm.serve.FRAME_VIDEO_FAMILIES`, :data:`~vtprune.vllm.serve.TOWER_FAMILY_NAMES`) must name exactly
the architectures whose processor ranks video frames (``frame_videos``) and recomputes the tower attention
(``tower_methods``). No engine is started."""

from __future__ import annotations

import importlib

import pytest

from vtprune.vllm.serve import FRAME_VIDEO_FAMILIES, TOWER_FAMILY_NAMES
from vtprune.vllm.settings import ARCHITECTURES, TOWER_METHODS

PROCESSORS = {  # the processor each pruned architecture registers (its module beside the model class)
    "VtpruneLlavaForConditionalGeneration": "VtpruneLlavaProcessor",
    "VtpruneQwen2VLForConditionalGeneration": "VtpruneQwen2VLProcessor",
    "VtpruneQwen2_5_VLForConditionalGeneration": "VtpruneQwen2_5_VLProcessor",
    "VtpruneLlavaNextForConditionalGeneration": "VtpruneLlavaNextProcessor",
    "VtpruneLlavaOnevisionForConditionalGeneration": "VtpruneLlavaOnevisionProcessor",
    "VtpruneQwen3VLForConditionalGeneration": "VtpruneQwen3VLProcessor",
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_serves_family_lists_match_the_processors(architecture):
    module = importlib.import_module(ARCHITECTURES[architecture].split(":")[0])
    processor = getattr(module, PROCESSORS[architecture])
    assert (architecture in FRAME_VIDEO_FAMILIES) == bool(processor.frame_videos), architecture
    assert (architecture in TOWER_FAMILY_NAMES) == (set(processor.tower_methods) == set(TOWER_METHODS)), architecture
