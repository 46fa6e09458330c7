"""The embedded LLaVA in vLLM with the plugin: compact positions, equal to vtprune's positions="compact"."""

from families import FamilyChecks


class TestLlava(FamilyChecks):
    family = "llava"
    options = {"positions": "compact"}
    chunk = 4  # the first chunk ends two tokens into the image
