"""The layer-wise vLLM plugin's pure parts in the main venv (no vLLM here): plans, layouts, request reading,
chunk merging and the start-up checks; the request keys the front end and the server refuse. Engine tests: tests/vllm/test_layerwise*.py (vLLM venv)."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import TypedDict

import pytest
import torch

from vtprune.layout import select_kept
from vtprune.vllm.layerwise import config as lw_config
from vtprune.vllm.layerwise.layout import StepRequest, region_layout, slot_mapping
from vtprune.vllm.layerwise.plan import make_layer_plan
from vtprune.vllm.layerwise.records import RequestRecord
from vtprune.vllm.layerwise.requests import (
    carried_keep,
    carry_keep,
    pruned_table,
    request_keep,
    visual_positions,
)
from vtprune.vllm.layerwise.scoring import RequestView, merge_states, select
from vtprune.vllm.settings import VllmPruning, processor_keys


def test_fastv_and_pdrop_counts_by_hand():
    fastv = make_layer_plan("fastv", 0.25, 4)
    assert fastv.layers == (2,) and fastv.score_layers == (1,)
    assert fastv.kept_counts(16, 0.25) == (4,) and fastv.pruned_counts(16, 0.25) == (0, 12)
    assert fastv.pruned_counts(16, 1.0) == (0, 0) and fastv.pruned_counts(0, 0.25) == (0, 0)
    assert [fastv.region_of_layer(i) for i in range(4)] == [0, 0, 1, 1]
    pdrop = make_layer_plan("pdrop", 0.25, 4)
    # layers L/4, L/2, 3L/4 = 1, 2, 3 keep 0.25^(1/3) = 0.63, 0.25^(2/3) = 0.397, 0.25 of 16: 10, 6, 4 tokens
    assert pdrop.layers == (1, 2, 3) and pdrop.kept_counts(16, 0.25) == (10, 6, 4)
    assert pdrop.pruned_counts(16, 0.25) == (0, 6, 10, 12)
    assert make_layer_plan("fastv", 0.5, 32, layer=3).kept_counts(576, 0.5) == (288,)


@pytest.mark.parametrize("method, kwargs, match", [
    ("pdrop", {"min_layer": 2}, "would prune at layer 1.*give layer=2"),
    ("fastv", {"layer": 0}, "layer"),
    ("prefixkv", {}, "retains KV entries"),
    ("fastv", {"options": {"bogus": 1}}, "bad options"),
])
def test_bad_plans_refused(method, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_layer_plan(method, 0.25, 4, **kwargs)


def test_step_kinds_rows_and_kv_positions_by_hand():
    pruned = (0, 12)
    defer = StepRequest(0, 0, 8, 0, 26, pruned)
    final = StepRequest(1, 8, 10, 16, 26, pruned)
    decode = StepRequest(2, 18, 1, 26, 26, pruned)
    plain = StepRequest(3, 19, 5, 3, 10, (0, 0))
    recompute = StepRequest(4, 24, 30, 0, 26, pruned)  # a preempted request: prompt and 4 generated tokens again
    assert [r.kind for r in (defer, final, decode, plain, recompute)] == ["defer", "final", "decode", "plain", "final"]
    assert [r.rows(1) for r in (defer, final, decode, plain, recompute)] == [1, 14, 1, 5, 18]
    assert [r.seq_len(1) for r in (defer, final, decode, plain, recompute)] == [1, 14, 15, 8, 18]
    assert decode.kv_positions(1).tolist() == [14] and final.kv_positions(1).tolist() == list(range(14))
    assert plain.kv_positions(1).tolist() == [3, 4, 5, 6, 7] and defer.kv_positions(1).tolist() == [0]
    assert [r.rows(0) for r in (defer, final, decode)] == [8, 10, 1] and final.seq_len(0) == 26


def test_region_layout_and_slots_by_hand():
    requests = [StepRequest(0, 0, 1, 26, 26, (0, 12)), StepRequest(1, 1, 3, 2, 30, (0, 0))]
    layout = region_layout(requests, 1)
    assert layout.indices == [0, 1] and layout.query_lens == [1, 3] and layout.seq_lens == [15, 5]
    assert layout.query_start_loc().tolist() == [0, 1, 4] and layout.kv_positions.tolist() == [14, 2, 3, 4]
    table = torch.tensor([[7, 9], [3, 0]], dtype=torch.int32)  # request 0 holds blocks 7, 9; request 1 block 3
    # blocks of 8 slots: KV index 14 is slot 6 of request 0's second block; 2-4 are slots 2-4 of request 1's first
    assert slot_mapping(table, 8, layout).tolist() == [9 * 8 + 6, 3 * 8 + 2, 3 * 8 + 3, 3 * 8 + 4]


def test_request_reading_from_features():
    data = {"vtprune_keep_image": SimpleNamespace(data=torch.tensor(500_000))}
    image = SimpleNamespace(modality="image", data=data,
                            mm_position=SimpleNamespace(offset=3, length=4, is_embed=None))
    video = SimpleNamespace(modality="video", data=None,  # a timestamp (not an embedding) inside its range
                            mm_position=SimpleNamespace(offset=10, length=5,
                                                        is_embed=torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)))
    assert visual_positions([video, image]).tolist() == [3, 4, 5, 6, 10, 11, 13, 14]
    assert request_keep([video, image], 0.25) == 0.5 and request_keep([], 0.25) == 0.25
    plan = make_layer_plan("fastv", 0.25, 4)
    assert pruned_table(plan, [video, image], 0.25) == (0, 4) and pruned_table(plan, [], 0.25) == (0, 0)


def test_the_keep_travels_with_the_request_when_vllm_strips_its_items():
    """vLLM strips a prefix-cached item's data before the workers see it (LLaVA keeps none): the scheduler's keep,
    carried in the request's sampling parameters, wins; a disagreement or an unknown keep is refused, never the
    model's default guessed (it pruned a keep-1.0 request the scheduler had planned unpruned)."""
    def image(keep_ppm):
        data = None if keep_ppm is None else {"vtprune_keep_image": SimpleNamespace(data=torch.tensor(keep_ppm))}
        return SimpleNamespace(modality="image", data=data,
                               mm_position=SimpleNamespace(offset=3, length=8, is_embed=None))

    request = SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"other": 1}), mm_features=[image(1_000_000)])
    shared = request.sampling_params.extra_args
    carry_keep(request, request_keep(request.mm_features, 0.25))
    assert request.sampling_params.extra_args == {"other": 1, "vtprune_keep_ppm": 1_000_000} and shared == {"other": 1}
    carried = carried_keep(request.sampling_params)
    plan = make_layer_plan("fastv", 0.25, 4)
    stripped = [image(None)]
    assert carried == 1.0 and pruned_table(plan, stripped, 0.25, carried) == (0, 0)  # unpruned, as scheduled
    record = RequestRecord.create(plan, stripped, [0] * 12, 0.25, carried)
    assert record.kept == (8,) and record.pruned == (0, 0)
    with pytest.raises(RuntimeError, match="stripped"):
        request_keep(stripped, 0.25)
    with pytest.raises(RuntimeError, match="items carry keep 0.5 but its scheduler planned keep 1.0"):
        request_keep([image(500_000)], 0.25, carried)
    assert carried_keep(None) is None and carried_keep(SimpleNamespace(extra_args=None)) is None


def test_select_keeps_text_and_the_transformers_paths_top_visual_rows():
    view = RequestView.whole_prompt(8, torch.tensor([1, 2, 3, 4, 5]))
    scores = torch.tensor([[9.0, 0.1, 0.5, 0.3, 0.9, 0.2, 9.0, 9.0]])
    rows = select(scores, view, 2)
    mask = select_kept(scores, view.visual[None], torch.ones(1, 8, dtype=torch.bool), torch.tensor([2]))
    assert rows.tolist() == mask[0].nonzero().flatten().tolist() == [0, 2, 4, 6, 7]
    assert view.take(rows).ordinal.tolist() == [-1, 1, 3, -1, -1]


def test_select_keeps_a_prompts_last_row_when_it_is_visual():
    """A prompt ending on its image (``USER: <image>``): its last row, the one vLLM samples from, stays (inside the
    kept count), as in the transformers path (``vtprune.prefill.select_with_query``)."""
    view = RequestView.whole_prompt(6, torch.tensor([2, 3, 4, 5]))
    scores = torch.tensor([[9.0, 9.0, 0.8, 0.6, 0.7, 0.1]])
    rows = select(scores, view, 2)
    assert rows.tolist() == [0, 1, 2, 5] and int(view.take(rows).visual.sum()) == 2


def test_chunk_states_merge_along_tokens():
    first = {"ttv_pending": [(torch.ones(1, 2), torch.zeros(1, 2))], "norms": {3: torch.ones(1, 2)}, "inputs": {}}
    second = {"ttv_pending": [(torch.full((1, 3), 2.0), torch.ones(1, 3))], "norms": {3: torch.zeros(1, 3)},
              "inputs": {}}
    merged = merge_states([first, second])
    magnitude, direction = merged["ttv_pending"][0]
    assert magnitude.tolist() == [[1, 1, 2, 2, 2]] and direction.tolist() == [[0, 0, 1, 1, 1]]
    assert merged["norms"][3].tolist() == [[1, 1, 0, 0, 0]] and merged["inputs"] == {}
    with pytest.raises(RuntimeError, match="differ between the chunks"):
        merge_states([{"x": [1]}, {"x": [1, 2]}])


def engine_config(**changes):
    """A stand-in for vLLM's engine config with the fields the layer-wise start-up reads."""
    hf = SimpleNamespace(vtprune={"method": "fastv", "keep": 0.25}, model_type="llava", vision_config=None)
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=SimpleNamespace(num_hidden_layers=4),
                                     enforce_eager=True),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1, enable_dbo=False),
        scheduler_config=SimpleNamespace(async_scheduling=None, scheduler_cls=None,
                                         disable_hybrid_kv_cache_manager=False),
        speculative_config=None, kv_transfer_config=None)
    for path, value in changes.items():
        owner, name = path.split(".")
        setattr(getattr(config, owner), name, value)
    return config


def test_start_up_sets_the_scheduler():
    config = engine_config()
    lw_config.LayerwiseConfig.verify_and_update_config(config)
    assert config.scheduler_config.scheduler_cls == lw_config.SCHEDULER
    assert config.scheduler_config.async_scheduling is False and config.model_config.enforce_eager is True
    assert config.model_config.logits_processors == [lw_config.LOGPROBS_REFUSAL]  # prompt_logprobs refused
    pre_llm = engine_config()
    pre_llm.model_config.hf_config.vtprune = {"method": "divprune", "keep": 0.25}
    lw_config.LayerwiseConfig.verify_and_update_config(pre_llm)
    assert pre_llm.scheduler_config.scheduler_cls is None  # pre-LLM methods keep vLLM's own scheduler


class Compile(enum.IntEnum):
    NONE = 0
    VLLM_COMPILE = 3


class Graphs(enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    def has_piecewise_cudagraphs(self) -> bool:
        return "piecewise" in self.value


@pytest.mark.parametrize("compiled, static, mode, graphs, want_mode, want_graphs", [
    (False, True, None, None, Compile.NONE, Graphs.FULL_DECODE_ONLY),  # a GPU at vLLM's defaults
    (False, True, Compile.VLLM_COMPILE, Graphs.FULL_AND_PIECEWISE, Compile.NONE, Graphs.FULL_DECODE_ONLY),
    (True, True, Compile.VLLM_COMPILE, Graphs.PIECEWISE, Compile.VLLM_COMPILE, Graphs.FULL_DECODE_ONLY),  # PrefixKV
    (True, True, None, Graphs.NONE, None, Graphs.NONE),  # graphs turned off by the user stay off
    (False, False, None, None, Compile.NONE, None),  # a CPU: no CUDA graphs to keep
    (True, False, Compile.VLLM_COMPILE, None, Compile.VLLM_COMPILE, None),
])
def test_graph_settings(compiled, static, mode, graphs, want_mode, want_graphs):
    config = engine_config(**{"model_config.enforce_eager": False})
    config.compilation_config = SimpleNamespace(mode=mode, cudagraph_mode=graphs)
    lw_config.graph_settings(config, "fastv", compiled, modes=(Compile, Graphs), static_graphs=static)
    assert config.compilation_config.mode == want_mode and config.compilation_config.cudagraph_mode == want_graphs


@pytest.mark.parametrize("change, match", [
    ({"parallel_config.pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"parallel_config.decode_context_parallel_size": 2}, "context parallelism"),
    ({"speculative_config": None, "scheduler_config.async_scheduling": True}, "async_scheduling"),
    ({"scheduler_config.scheduler_cls": "mypkg.MyScheduler"}, "scheduler_cls"),
    ({"scheduler_config.disable_hybrid_kv_cache_manager": True}, "disable_hybrid_kv_cache_manager"),
    ({"parallel_config.enable_dbo": True}, "micro-batching"),
])
def test_start_up_refusals_are_one_line(change, match):
    config = engine_config(**{k: v for k, v in change.items() if "." in k})
    with pytest.raises(ValueError, match=match) as error:
        lw_config.LayerwiseConfig.verify_and_update_config(config)
    assert "\n" not in str(error.value)


def test_vllms_v2_model_runner_is_refused_in_one_line():
    for method in ("fastv", "prefixkv"):
        config = engine_config()
        config.model_config.hf_config.vtprune = {"method": method, "keep": 0.25}
        config.use_v2_model_runner = True
        with pytest.raises(ValueError, match="V1 model runner.*VLLM_USE_V2_MODEL_RUNNER=0") as error:
            lw_config.LayerwiseConfig.verify_and_update_config(config)
        assert "\n" not in str(error.value)


def test_speculative_decoding_and_kv_connectors_refused():
    for field in ("speculative_config", "kv_transfer_config"):
        config = engine_config()
        setattr(config, field, object())
        with pytest.raises(ValueError, match="speculative|connector"):
            lw_config.LayerwiseConfig.verify_and_update_config(config)


# -- PrefixKV (vtprune.vllm.layerwise.retention) ----------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"scope": "prompt"}, "scope='prompt' evicts text entries.*drop scope='prompt'"),
    ({"query_rows": 0}, "query_rows=0 must be a positive int"),
    ({"profile": "p.json"}, "calibrated profile.*drop profile='p.json'"),
])
def test_prefixkv_options_the_plugin_does_not_serve_are_refused_in_one_line(options, match):
    from vtprune.vllm.layerwise.plan import make_retention_scorer

    with pytest.raises(ValueError, match=match) as error:
        make_retention_scorer("prefixkv", options)
    assert "\n" not in str(error.value)
    assert make_retention_scorer("prefixkv", {"query_rows": 8}).query_rows == 8
    with pytest.raises(ValueError, match="prunes the sequence"):
        make_retention_scorer("fastv")


def test_prefixkv_query_rows_are_the_transformers_paths():
    from vtprune.vllm.layerwise.retention import query_rows

    assert query_rows(10, None).tolist() == list(range(10)) and query_rows(10, 12).tolist() == list(range(10))
    assert query_rows(10, 4).tolist() == [0, 3, 6, 9]  # evenly spaced, the last row included
    assert query_rows(7, 1).tolist() == [0]


def test_received_attention_sums_over_row_chunks_as_over_the_whole_prompt():
    """The vLLM plugin sums a chunked prefill's rows chunk by chunk; both equal an explicit causal softmax."""
    from vtprune.scoring import received_attention_sum

    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 9, 8, generator=generator), torch.randn(1, 2, 9, 8, generator=generator)
    scale = 8 ** -0.5
    logits = torch.einsum("hqd,hkd->hqk", query[0], key[0].repeat_interleave(2, dim=0)) * scale
    logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.softmax(logits, dim=-1).mean(dim=0).sum(dim=0)  # heads averaged, rows summed
    rows = torch.arange(9)[None]
    ones = torch.ones(1, 9, dtype=torch.bool)
    whole = received_attention_sum(query, key, rows, ones, ones, scale)[0]
    first = received_attention_sum(query[:, :, :4], key[:, :, :4], rows[:, :4], ones[:, :4], ones[:, :4], scale)[0]
    second = received_attention_sum(query[:, :, 4:], key, rows[:, 4:], ones[:, 4:], ones, scale)[0]
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first, torch.zeros(5)]) + second, expected, atol=1e-5, rtol=1e-5)


class ImageKwargs(TypedDict, total=False):
    max_pixels: int


class ProcessorKwargs(TypedDict, total=False):
    images_kwargs: ImageKwargs


def test_a_key_the_processor_does_not_take_is_refused():
    processor = type("P", (), {"valid_processor_kwargs": ProcessorKwargs, "image_processor": None})()
    allowed = processor_keys(processor)
    assert allowed == {"images_kwargs", "max_pixels"}
    pruning = VllmPruning.from_dict({"keep": 0.25})
    assert pruning.request_keep({"vtprune_keep": 0.5, "max_pixels": 1000}, allowed) == 0.5
    with pytest.raises(ValueError, match="unknown request key.*'ratio'.*not an option of the model's processor"):
        pruning.request_keep({"ratio": 0.5}, allowed)


def test_a_top_level_keep_is_a_bad_request_at_the_server():
    import asyncio
    import json

    from vtprune.vllm.middleware import OPTION, RequestKeyCheck, server_options

    def call(body: dict) -> tuple[list, list]:
        seen, sent = [], []

        async def app(scope, receive, send):
            seen.append(json.loads((await receive())["body"]))

        chunks = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            return chunks.pop(0)

        async def send(message):
            sent.append(message)

        asyncio.run(RequestKeyCheck(app)({"type": "http", "method": "POST"}, receive, send))
        return seen, sent

    assert server_options(["--port", "1"]) == list(OPTION) and server_options(list(OPTION)) == []
    good = {"model": "m", "mm_processor_kwargs": {"vtprune_keep": 0.5}}
    assert call(good) == ([good], [])  # handed on unchanged
    seen, sent = call({"model": "m", "vtprune_keep": 0.5})
    assert seen == [] and sent[0]["status"] == 400
    assert "'vtprune_keep' at the top level" in json.loads(sent[1]["body"])["error"]["message"]


@pytest.mark.parametrize("chunked, want_gib", [(True, 6.0), (False, 4.0)])
def test_prefixkv_held_entries_bound_by_hand(chunked, want_gib):
    """LLaVA-1.5-7B's language model in bfloat16: 32 layers x 2 x 32 KV heads x 128 x 2 bytes = 0.5 MiB per token;
    8,192 batched tokens, plus a 4,096-token partial prompt when chunked prefill is on."""
    model = SimpleNamespace(max_model_len=4096, dtype=torch.bfloat16, get_num_layers=lambda parallel: 32,
                            get_num_kv_heads=lambda parallel: 32, get_head_size=lambda: 128)
    scheduler = SimpleNamespace(max_num_batched_tokens=8192, enable_chunked_prefill=chunked)
    config = SimpleNamespace(model_config=model, parallel_config=None, scheduler_config=scheduler)
    assert lw_config.held_entries_bytes(config) == want_gib * 2**30
