"""Shared engines and inputs of the vLLM plugin tests (run by the vLLM venv's pytest: bash scripts/setup_vllm.sh).

vLLM engines take about a minute to start on a CPU, so each test module starts at most two (module-scoped)
and runs several tests on each; one engine is alive at a time. Settings: float32, eager, 1 thread, 1 GiB KV.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM venv (bash scripts/setup_vllm.sh)")

PRUNED = {"llava": "VtpruneLlavaForConditionalGeneration", "qwen2_vl": "VtpruneQwen2VLForConditionalGeneration"}
QUESTIONS = 6


def make_llm(family: str, pruned: bool = True, method: str = "divprune", keep: float = 0.25, **options):
    """An ``LLM`` on an embedded model (stock, or pruned through the plugin), small and deterministic."""
    from vllm import LLM

    from vtprune.vllm.export import model_folder

    overrides = ({"architectures": [PRUNED[family]], "vtprune": {"method": method, "keep": keep}}
                 if pruned else None)
    settings = dict(enforce_eager=True, dtype="float32", max_model_len=256, seed=0, hf_overrides=overrides,
                    limit_mm_per_prompt={"image": 2}, max_num_seqs=8)
    settings.update(options)
    return LLM(model_folder(f"embedded:{family}"), **settings)


def shutdown(llm) -> None:
    """Stop an engine's processes now (the next module starts its own)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def chat_prompt(llm, question: str) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generate(llm, items, keeps=None, max_tokens: int = 4, logprobs: int = 0):
    """``[(new token ids, prompt length, cached tokens)]`` of greedy answers; ``keeps[i]``: request keep;
    ``logprobs``: a fourth element, ``{token: log-probability}`` of the first step's top ``logprobs`` tokens."""
    from vllm import SamplingParams

    requests = []
    for index, (image, question) in enumerate(items):
        request = {"prompt": chat_prompt(llm, question), "multi_modal_data": {"image": image}}
        if keeps is not None and keeps[index] is not None:
            request["mm_processor_kwargs"] = {"vtprune_keep": keeps[index]}
        requests.append(request)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs or None)
    outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
    rows = [(list(o.outputs[0].token_ids), len(o.prompt_token_ids), o.num_cached_tokens or 0) for o in outputs]
    if logprobs:
        rows = [row + ({t: p.logprob for t, p in o.outputs[0].logprobs[0].items()},) for row, o in zip(rows, outputs)]
    return rows


def selections(llm, clear: bool = False) -> list[list[int]]:
    """The kept rows the plugin selected since the last clear (read from the worker)."""
    from vtprune.vllm.common import clear_selections, recent_selections

    rows = llm.apply_model(recent_selections)[0]
    if clear:
        llm.apply_model(clear_selections)
    return rows


@pytest.fixture(scope="session")
def items():
    """``QUESTIONS`` (image, question) pairs of the vtprune-shapes test split."""
    from vtprune.shapes.task import make_split

    return [(sample.image, sample.questions[0].text) for sample in make_split("test", QUESTIONS)]
