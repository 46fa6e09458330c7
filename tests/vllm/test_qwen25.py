"""Qwen2.5-VL with the plugin on a tiny random-weight config (vLLM dummy weights, the embedded Qwen2-VL's
tokenizer and image processor): keep 1.0 equals stock vLLM; keep 0.25 reserves a quarter of the placeholders."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import chat_prompt, shutdown

VISION = {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
          "out_hidden_size": 192, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
          "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2, "hidden_act": "silu",
          "in_channels": 3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from vtprune.models.embedded import embedded_model_path

    source, target = embedded_model_path("qwen2_vl"), tmp_path_factory.mktemp("qwen25")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "generation_config.json"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config.update(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", vision_config=VISION)
    config["text_config"]["model_type"] = "qwen2_5_vl_text"
    (target / "config.json").write_text(json.dumps(config))
    return target


def answers(llm, items, keeps):
    from vllm import SamplingParams

    requests = [{"prompt": chat_prompt(llm, question), "multi_modal_data": {"image": image}} for image, question in items]
    for request, keep in zip(requests, keeps):
        if keep is not None:
            request["mm_processor_kwargs"] = {"vtprune_keep": keep}
    outputs = llm.generate(requests, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in outputs]


def test_qwen25_keep_one_equals_stock_and_keep_quarter_prunes(folder, items):
    chosen = items[:3]
    from vllm import LLM

    settings = dict(enforce_eager=True, dtype="float32", max_model_len=256, seed=0, max_num_seqs=4,
                    load_format="dummy")  # the same seeded dummy weights in both engines
    stock = LLM(str(folder), **settings)
    try:
        want = answers(stock, chosen, [None] * 3)
    finally:
        shutdown(stock)
    pruned = LLM(str(folder), hf_overrides={"architectures": ["VtpruneQwen2_5_VLForConditionalGeneration"],
                                            "vtprune": {"method": "divprune", "keep": 0.25}}, **settings)
    try:
        assert answers(pruned, chosen, [1.0] * 3) == want
        quarter = answers(pruned, chosen, [0.25] * 3)
        assert [length for _, length in quarter] == [length - 12 for _, length in want]  # 4 of 16 placeholders
    finally:
        shutdown(pruned)
