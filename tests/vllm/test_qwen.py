"""The embedded Qwen2-VL in vLLM with the plugin: original M-RoPE positions, equal to vtprune's default."""

from families import FamilyChecks


class TestQwen2VL(FamilyChecks):
    family = "qwen2_vl"
    options = {}
    chunk = 3  # the first chunk ends right after <|vision_start|> (vLLM's EVS position helper fails there)
