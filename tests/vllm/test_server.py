"""`vtprune serve --method fastv` end to end: vLLM's OpenAI server on 127.0.0.1 with FastV inside the language model,
base64 images, per-request keeps (clients may send ``vtprune_keep``; a misspelled key, a key the processor does not
take, a non-number, a keep outside ``mm_processor_kwargs`` and ``prompt_logprobs`` are a 400), and a method the plugin
cannot serve refused when an engine starts. The wait for the server has no time limit of its own
(a loaded machine took over 12 minutes to start an engine): it ends when the server answers or exits, or when
test.sh's overall timeout stops the run."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import reference
from conftest import make_llm

REQUESTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise AssertionError(f"HTTP {error.code}: {error.read().decode()[:500]}") from None


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = dict(os.environ, VTPRUNE_VLLM_PYTHON=sys.executable)
    process = subprocess.Popen([sys.executable, "-m", "vtprune", "serve", "embedded:qwen2_vl", "--method", "fastv",
                                "--keep", "0.25", "--port", str(port), "--max-num-seqs", "4",
                                "--trust-request-mm-kwargs", "--middleware", "vtprune.vllm.middleware.RequestKeyCheck"],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vtprune serve exited with {process.returncode} before the server answered")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=5) as response:
                    model = json.loads(response.read())["data"][0]["id"]
                break
            except OSError:
                time.sleep(2)
        yield base, model
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def chat(image, question: str, model_name: str, **extra) -> dict:
    return {"model": model_name, "max_tokens": 4, "temperature": 0.0, **extra,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                      {"type": "text", "text": question}]}]}


def test_openai_server_answers_as_transformers_path(server, items):
    base, model_name = server
    model, processor = reference.load("qwen2_vl")
    chosen = items[:REQUESTS]
    for keep in (0.25, 1.0):
        method = "fastv" if keep < 1 else None
        want = [processor.tokenizer.decode(ids, skip_special_tokens=True).strip()
                for ids, _ in reference.answers(model, processor, chosen, method, keep)]
        got = []
        for image, question in chosen:
            extra = {"mm_processor_kwargs": {"vtprune_keep": 1.0}} if keep == 1.0 else {}
            body = chat(image, question, model_name, **extra)
            got.append(post(base + "/v1/chat/completions", body)["choices"][0]["message"]["content"].strip())
        assert got == want, keep


@pytest.mark.parametrize("kwargs, words", [({"vtprune_kep": 0.5}, "unknown request key"),
                                           ({"vtprune_keep": True}, "not a number"),
                                           ({"ratio": 0.5}, "unknown request key.*'ratio'")])
def test_a_keep_that_would_not_be_applied_is_a_bad_request(server, items, kwargs, words):
    base, model_name = server
    image, question = items[0]
    with pytest.raises(AssertionError, match=f"HTTP 400.*{words}"):
        post(base + "/v1/chat/completions", chat(image, question, model_name, mm_processor_kwargs=kwargs))


@pytest.mark.parametrize("extra, words", [({"vtprune_keep": 0.5}, "'vtprune_keep' at the top level"),
                                          ({"prompt_logprobs": 1}, "prompt_logprobs is not served")])
def test_a_top_level_keep_and_prompt_logprobs_are_bad_requests(server, items, extra, words):
    """A keep outside ``mm_processor_kwargs`` would be dropped by vLLM; pruned prompt positions have no exact
    log-probability: both are refused in one line, and the server goes on."""
    base, model_name = server
    image, question = items[0]
    with pytest.raises(AssertionError, match=f"HTTP 400.*{words}"):
        post(base + "/v1/chat/completions", chat(image, question, model_name, **extra))
    assert post(base + "/v1/chat/completions", chat(image, question, model_name))["choices"][0]["message"]["content"]


def test_a_method_the_plugin_cannot_serve_is_refused_at_start(capfd):
    with pytest.raises(Exception) as error:
        make_llm("qwen2_vl", method="oracle")
    output = str(error.value) + "".join(capfd.readouterr())
    assert "method 'oracle' is not available in the vLLM plugin" in output
    assert "methods that work in vLLM: divprune, random" in output
