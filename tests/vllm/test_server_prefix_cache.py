"""Through `vtprune serve` (FastV, prefix caching on): the same image and question twice at ``vtprune_keep: 1.0``,
then a pruned request, on LLaVA-1.5, LLaVA-NeXT and LLaVA-OneVision.

vLLM strips a prefix-cached item's multimodal data before the workers see it (``strip_covered_mm_data``; M-RoPE
models keep their CPU fields, the LLaVA family none). Before, the worker then fell back to the model's keep (0.25)
and pruned a request the scheduler had planned unpruned: ``IndexError`` in ``project_qk``, HTTP 500, and the server
exited. The scheduler now carries each request's keep in its sampling parameters: the repeat hits the prefix cache,
answers as the unpruned transformers model, and the server goes on to answer a pruned request as the transformers
path does (token ids, end-of-sequence ignored).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import reference
from layerwise_support import reference_steps
from test_server import chat, free_port, post

FAMILIES = ("llava", "llava_next", "llava_onevision")
TOKENS = 4
#: after the question, so that the prompt runs at least 32 tokens past the image: the full blocks (of 32 tokens) the
#: repeat reads from the prefix cache then cover the image, whose data vLLM strips
TAIL = " Answer with one word, then stop, please." * 4


def wait_for(process: subprocess.Popen, base: str, log: str) -> str:
    """The served model's name once the server answers (no time limit of its own, as tests/vllm/test_server.py)."""
    while True:
        if process.poll() is not None:
            with open(log) as handle:
                tail = handle.read()[-3000:]
            pytest.fail(f"vtprune serve exited with {process.returncode} before the server answered:\n{tail}")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
                return json.loads(response.read())["data"][0]["id"]
        except OSError:
            time.sleep(2)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """``(base url, model name, folder)`` of a FastV server at keep 0.25 whose clients may send their keep."""
    from vtprune.vllm.export import model_folder

    family = request.param
    if family == "llava":
        model, folder = "embedded:llava", model_folder("embedded:llava")
    else:
        from tiny_folders import BUILDERS

        folder = str(BUILDERS[family](tmp_path_factory.mktemp(family), layers=4))
        model = folder
    port, log = free_port(), str(tmp_path_factory.mktemp("log") / "serve.log")
    env = dict(os.environ, VTPRUNE_VLLM_PYTHON=sys.executable)
    command = [sys.executable, "-m", "vtprune", "serve", model, "--method", "fastv", "--keep", "0.25", "--port",
               str(port), "--max-num-seqs", "2", "--trust-request-mm-kwargs", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--block-size", "32", "--dtype", "float32", "--max-model-len", "512",
               "--enforce-eager"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, wait_for(process, base, log), folder
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def ask(base: str, body: dict) -> dict:
    return post(base + "/v1/chat/completions", {**body, "max_tokens": TOKENS, "ignore_eos": True,
                                                 "return_token_ids": True})


def test_a_repeat_at_keep_one_hits_the_prefix_cache_and_the_server_goes_on(served, items):
    base, name, folder = served
    image, question = items[0][0], items[0][1] + TAIL
    model, processor = reference.load_folder(folder)
    unpruned = reference_steps(model, processor, [(image, question)], None, 1.0, steps=TOKENS)[0][0]
    pruned = reference_steps(model, processor, [(image, question)], "fastv", 0.25, steps=TOKENS)[0][0]
    whole = chat(image, question, name, mm_processor_kwargs={"vtprune_keep": 1.0})
    first, second = ask(base, whole), ask(base, whole)
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached > 0 and second["usage"]["prompt_tokens"] - cached <= 32  # every full block: the image's too
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == unpruned
    assert ask(base, chat(image, question, name))["choices"][0]["token_ids"] == pruned  # keep 0.25, still serving
