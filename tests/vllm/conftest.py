"""Shared engines and inputs of the vLLM plugin tests (run by the vLLM venv's pytest: bash scripts/setup_vllm.sh).

Engines run in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: a start takes 5-20 s on 2 cores) and are
module- or class-scoped, several tests on each; one engine is alive at a time. Settings: float32, eager, 1 thread,
1 GiB KV.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

for key, value in {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                   # engines in the test process (a start takes 5-20 s instead of about a minute on 2 cores);
                   # tensor parallelism still runs its ranks in worker processes
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).parent))
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):  # pytest-xdist (test.sh): one core per worker
    _cpus = sorted(os.sched_getaffinity(0))  # vLLM's own binding would put every worker's engine on the first core
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_cpus)]))

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
                    limit_mm_per_prompt={"image": 2, "video": 1} if family == "qwen2_vl" else {"image": 2},
                    max_num_seqs=8)
    settings.update(options)
    return LLM(model_folder(f"embedded:{family}"), **settings)


def shutdown(llm) -> None:
    """Stop an engine's processes now (the next module starts its own)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def chat_prompt(llm, question: str, images: int = 1) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": question}]}]
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generate(llm, items, keeps=None, max_tokens: int = 4, logprobs: int = 0):
    """``[(new token ids, prompt length, cached tokens)]`` of greedy answers; ``keeps[i]``: request keep;
    ``logprobs``: a fourth element, ``{token: log-probability}`` of the first step's top ``logprobs`` tokens.
    An item's image may be a list of images (several per prompt, in that order)."""
    from vllm import SamplingParams

    requests = []
    for index, (image, question) in enumerate(items):
        count = len(image) if isinstance(image, list) else 1
        request = {"prompt": chat_prompt(llm, question, count), "multi_modal_data": {"image": image}}
        if keeps is not None and keeps[index] is not None:
            request["mm_processor_kwargs"] = {"vtprune_keep": keeps[index]}
        requests.append(request)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs or None)
    outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
    rows = [(list(o.outputs[0].token_ids), len(o.prompt_token_ids), o.num_cached_tokens or 0) for o in outputs]
    if logprobs:
        rows = [row + ({t: p.logprob for t, p in o.outputs[0].logprobs[0].items()},) for row, o in zip(rows, outputs)]
    return rows


def assert_same_answers(got, expected, tolerance: float = 1e-3) -> None:
    """``got`` (:func:`generate` rows with ``logprobs``) gives the greedy ids of ``expected``
    (``reference.answers(..., logprobs=True)`` rows) and its first step's log-probabilities within ``tolerance``
    (float32: vLLM's CPU kernels against transformers' SDPA)."""
    assert [row[0] for row in got] == [row[0] for row in expected]
    for (*_, top), (_, _, reference_logprobs) in zip(got, expected, strict=True):
        assert max(abs(value - reference_logprobs[token]) for token, value in top.items()) < tolerance


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


@pytest.fixture(scope="session")
def clip():
    """``(frames, question)``: 8 frames (112 x 112, 4 temporal patches on Qwen2-VL) of a vtprune-shapes video."""
    from vtprune.shapes.video import generate_video_sample

    sample = generate_video_sample(0, 0)
    return sample.frames[:8], sample.questions[0].text


def generate_video(llm, frames, question: str, max_tokens: int = 4) -> list[int]:
    """Greedy new token ids of one video request (the prompt of :func:`reference.video_prompt`)."""
    import numpy as np
    import reference
    from vllm import SamplingParams

    request = {"prompt": reference.video_prompt(llm.get_tokenizer(), question),
               "multi_modal_data": {"video": np.stack([np.asarray(f) for f in frames])}}
    out = llm.generate([request], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)
