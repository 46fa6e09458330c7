"""``prompt_logprobs`` on an engine serving a sequence-pruning layer-wise method: refused at the request, in one line.

A pruned request's layers after a stage run on its kept tokens only, and a chunk of its prompt that does not end it
runs those layers on one placeholder row (:mod:`vtprune.vllm.layerwise.runtime`): the final norm's hook writes a zero
row at every pruned visual position and at every position of a deferred chunk, so vLLM would report ``-log V`` for
them (under chunked prefill, vLLM's default for long prompts, the whole prompt outside its last chunk). Rather than
return numbers that look like log-probabilities, the engine refuses ``prompt_logprobs``; generated tokens'
``logprobs`` are exact.

vLLM seam: a custom logits processor's ``validate_params`` classmethod, which vLLM's front end calls for every request
before it reaches the engine (vLLM turns a ``ValueError`` there into its ``VLLMValidationError``: HTTP 400 from the
OpenAI server, raised by ``LLM.generate``). The processor itself changes no logits. The front end sees the sampling parameters only, not
whether the request prunes, so every request of such an engine is refused ``prompt_logprobs`` (text-only and keep
1.0 requests too).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

#: the one-line message of a refused ``prompt_logprobs``
REFUSAL = ("vtprune: prompt_logprobs is not served with a layer-wise pruning method (its pruned layers run on the kept "
           "tokens only, so pruned positions have no exact prompt log-probability); drop prompt_logprobs (generated "
           "tokens' logprobs are exact), or score prompts with vtprune's transformers path.")


class PromptLogprobsRefusal(LogitsProcessor):
    """Refuses ``prompt_logprobs`` at the front end (``validate_params``); leaves every logit as it is."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        if getattr(sampling_params, "prompt_logprobs", None) is not None:
            raise ValueError(REFUSAL)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
