"""The serving benchmark's engines (``vtprune bench serving``), without vLLM: the 32-layer proxy's geometry, the
memory-bound run's KV budget by hand, the engines' options (stock vLLM at its defaults) and the refusals."""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import pytest
from vtprune.eval.speed.serving import proxy_folder
from vtprune.eval.speed.serving_engines import engine_options, layer_blocks, memory_bound, memory_bound_bytes
from vtprune.eval.speed.serving_options import parse


def _args(**changes) -> argparse.Namespace:
    values = dict(max_model_len=1024, dtype="float32", concurrency=[1, 32], max_tokens=8)
    values.update(changes)
    return argparse.Namespace(**values)


def test_the_default_proxy_has_llava_geometry_and_32_layers(tmp_path):
    folder = proxy_folder("proxy576x32", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2 == 576
    assert config["text_config"]["num_hidden_layers"] == 32 and config["image_seq_length"] == 576
    assert parse(["--out", str(tmp_path / "out")]).models == "proxy576x32"


def test_the_7b_layer_proxy_has_four_of_llava_7bs_layers_and_the_small_tower(tmp_path):
    text = json.loads((proxy_folder("proxy7bx4", tmp_path) / "config.json").read_text())["text_config"]
    seven = json.loads((proxy_folder("proxy7b", tmp_path) / "config.json").read_text())
    assert text["num_hidden_layers"] == 4 and seven["text_config"]["num_hidden_layers"] == 32
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim"):
        assert text[name] == seven["text_config"][name]
    tower = json.loads((proxy_folder("proxy7bx4", tmp_path) / "config.json").read_text())["vision_config"]
    assert tower["num_hidden_layers"] == 1 and tower["image_size"] // tower["patch_size"] == 24
    assert parse(["--models", "proxy7bx4", "--out", str(tmp_path / "out")]).models == "proxy7bx4"


def test_memory_bound_budget_by_hand(tmp_path):
    # 586 prompt + 8 output tokens = 594: 5 blocks of 128 in each of 32 layers; a token in a layer holds
    # 2 x 4 KV heads x 64 x 4 bytes = 2 KiB: 640 x 32 x 2 KiB = 40 MiB per request
    folder = proxy_folder("proxy576x32", tmp_path)
    assert memory_bound_bytes(folder, 8, 128, _args()) == 8 * 40 * 2**20
    assert memory_bound_bytes(folder, 1, 32, _args(dtype="bfloat16")) == 19 * 32 * 32 * 1024  # ceil(594 / 32) = 19
    bound, budget = memory_bound(folder, 8, 128, _args())
    assert budget == 8 * 40 * 2**20 and bound.max_model_len == 640  # one request in whole blocks: vLLM accepts it


def test_stock_engine_keeps_vllms_defaults_and_pruned_engines_name_the_plugin(tmp_path):
    folder = proxy_folder("proxy576x32", tmp_path)
    stock = engine_options(folder, "proxy576x32", "none", 0.25, _args())
    assert "enforce_eager" not in stock and "hf_overrides" not in stock and "enable_prefix_caching" not in stock
    assert stock["load_format"] == "dummy" and stock["max_num_seqs"] == 32
    pruned = engine_options(folder, "proxy576x32", "prefixkv", 0.25, _args(), kv_bytes=1234)
    assert pruned["hf_overrides"]["vtprune"] == {"method": "prefixkv", "keep": 0.25}
    assert pruned["kv_cache_memory_bytes"] == 1234


def test_blocks_are_counted_per_layer_over_the_kv_groups():
    # group 0: 2 layers, 5 blocks of the request; group 1: 6 layers, 2 blocks: (5 x 2 + 2 x 6) / 8 layers
    groups = [SimpleNamespace(layer_names=["a", "b"]), SimpleNamespace(layer_names=list("cdefgh"))]
    managers = [SimpleNamespace(req_to_blocks={"r": [0] * 5}), SimpleNamespace(req_to_blocks={"r": [0] * 2})]
    scheduler = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
                                kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(
                                    single_type_managers=managers)))
    assert layer_blocks(scheduler, "r") == pytest.approx(22 / 8)
    assert layer_blocks(scheduler, "gone") is None


def test_a_memory_bound_budget_that_holds_the_concurrency_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as error:
        parse(["--concurrency", "1,8", "--memory-bound", "8", "--out", str(tmp_path / "out")])
    assert error.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "fewer unpruned requests than the highest --concurrency (8)" in message[0]
    assert parse(["--concurrency", "1,8", "--memory-bound", "0", "--out", str(tmp_path / "out")]).memory_bound == 0
    assert parse(["--concurrency", "1,32", "--out", str(tmp_path / "out")]).memory_bound == 8  # a quarter


def test_a_memory_bound_engine_starts_without_vllm_cpus_legacy_kv_size(monkeypatch):
    from vtprune.eval.speed.serving_engines import kv_space

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with kv_space(1234):
        assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # it would replace kv_cache_memory_bytes
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"
    with kv_space(None):
        assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_kv_memory_counts_the_run_dtypes_bytes():
    # 594 tokens of the 32-layer proxy (4 KV heads x 64): 38 blocks of 16 per layer, 2 x 4 x 64 values per token;
    # float32 4 bytes a value: 38 x 16 x 512 x 4 x 32 layers = 38 MiB; bfloat16 half of it
    from vtprune.eval.speed.serving import summary

    config = {"text_config": {"num_key_value_heads": 4, "head_dim": 64, "hidden_size": 256,
                              "num_attention_heads": 4, "num_hidden_layers": 32}}
    records = [{"ttft": 0.1, "tpot": 0.01, "prompt": 586, "output": 8}]
    rows = {dtype: summary("proxy576x32", "vllm", "none", 1.0, 1, records, 1.0, config, 576, 576,
                           argparse.Namespace(block_size=16, kv_budget_gib=8.0, dtype=dtype))
            for dtype in ("float32", "bfloat16")}
    assert rows["float32"]["kv_mib_per_req"] == pytest.approx(38.0)
    assert rows["bfloat16"]["kv_mib_per_req"] == pytest.approx(19.0)
