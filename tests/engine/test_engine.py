"""Behaviour of the engine on tiny random models of every supported family (CPU, offline)."""

from __future__ import annotations

import functools

import pytest
import torch

import vtprune
from vtprune.models.tiny import TINY_TYPES, random_image, tiny_inputs, tiny_model

torch.set_num_threads(1)
IMPLS = ("sdpa", "eager")


@functools.cache
def _model(model_type: str, impl: str):
    return tiny_model(model_type, impl, image_size=112)


def _first_layer(model_type: str) -> int:
    return 2


def _hooks(model) -> list:
    """Every hook function registered on every submodule (transformers installs some of its own)."""
    return [(name, kind, list(getattr(module, kind).values()))
            for name, module in model.named_modules()
            for kind in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")]


def _inputs(model_type: str, processor, samples=None):
    samples = samples or [("what color is the circle?", [random_image(120, 90, 0)])]
    return tiny_inputs(processor, model_type, samples)


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_keep_one_equals_unwrapped_and_remove_restores(model_type):
    model, processor = _model(model_type, "sdpa")
    inputs = _inputs(model_type, processor)
    with torch.no_grad():
        reference = model(**inputs).logits
        pristine = _hooks(model)
        handle = vtprune.wrap(model, "fastv", keep=1.0, layer=_first_layer(model_type))
        same = model(**inputs).logits
        handle.remove()
        after = model(**inputs).logits
    torch.testing.assert_close(same, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(after, reference, atol=0, rtol=0)
    assert _hooks(model) == pristine


def _generate(model, inputs, steps=4):
    from vtprune.models.tiny import SPECIAL_TOKENS

    # Random weights may emit placeholder tokens; keep generated text free of them.
    specials = list(range(len(SPECIAL_TOKENS)))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             suppress_tokens=specials,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, inputs["input_ids"].shape[1]:], torch.stack(out.logits, dim=1)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens with the placeholder tokens suppressed, as in :func:`_generate`."""
    from vtprune.models.tiny import SPECIAL_TOKENS

    return logits.clone().index_fill_(-1, torch.arange(len(SPECIAL_TOKENS)), float("-inf")).argmax(-1)


def _recompute(model, inputs, generated, kept_masks, stages):
    """Forward of prompt + generated tokens without cache, keeping exactly ``kept_masks`` (oracle)."""
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], generated[:, :-1]], dim=1)
    extra = generated.shape[1] - 1
    full["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(generated[:, :-1])], dim=1)
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(generated[:, :-1])], dim=1)
    with torch.no_grad():
        with vtprune.apply(model, "oracle", schedule=",".join(f"{s.layer}:{s.keep}" for s in stages)) as handle:
            handle.set_evidence(kept_masks)
            logits = model(**full, use_cache=False).logits
    return logits[:, -(extra + 1):]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_cached_decoding_equals_recomputation(model_type, impl):
    model, processor = _model(model_type, impl)
    inputs = _inputs(model_type, processor)
    schedule = "2:0.5" if model_type == "qwen3_vl" else "1:0.75,3:0.4"
    with vtprune.apply(model, "fastv", schedule=schedule) as handle:
        generated, logits = _generate(model, inputs)
        stats = handle.last_stats
        stages = handle.stages
    # Nested weights make the oracle keep, at every stage, exactly what the cached run kept.
    weights = torch.zeros(stats.visual_tokens[0])
    for kept in stats.kept_indices:
        weights[torch.tensor(kept[0])] += 1.0
    recomputed = _recompute(model, inputs, generated, [weights], stages)
    torch.testing.assert_close(recomputed, logits, atol=1e-4, rtol=0)
    assert torch.equal(_greedy(recomputed), generated)


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_batch_equals_samples_alone(model_type):
    model, processor = _model(model_type, "sdpa")
    if model_type.startswith("qwen"):
        samples = [("what color is the circle?", [random_image(120, 90, 1)]),
                   ("how many?", [random_image(64, 64, 2)])]
    else:
        samples = [("what color is the circle?", [random_image(120, 90, 1)]),
                   ("how many squares are there?", [random_image(64, 80, 2), random_image(90, 60, 3)])]
    layer = _first_layer(model_type)
    with vtprune.apply(model, "fastv", keep=0.3, layer=layer) as handle:
        batch_tokens, batch_logits = _generate(model, _inputs(model_type, processor, samples), steps=3)
        batch_stats = handle.last_stats
        for row, sample in enumerate(samples):
            alone_tokens, alone_logits = _generate(model, _inputs(model_type, processor, [sample]), steps=3)
            alone_stats = handle.last_stats
            torch.testing.assert_close(batch_logits[row], alone_logits[0], atol=1e-4, rtol=0)
            assert torch.equal(batch_tokens[row], alone_tokens[0])
            assert batch_stats.kept_indices[0][row] == alone_stats.kept_indices[0][0]
            assert batch_stats.visual_tokens[row] == alone_stats.visual_tokens[0]


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_recomputed_attention_equals_eager_weights(model_type):
    from vtprune.adapters import get_adapter
    from vtprune.kernels import visual_attention_scores

    model, processor = _model(model_type, "eager")
    inputs = _inputs(model_type, processor)
    adapter = get_adapter(model)
    captured = {}
    layer_index = 1
    layer = adapter.decoder_layers[layer_index]

    def grab(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs["hidden_states"]
        captured["rope"] = kwargs["position_embeddings"]

    hook = layer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    hook.remove()
    hidden = captured["hidden"]
    queries = torch.tensor([[hidden.shape[1] - 1, hidden.shape[1] - 5]])
    with torch.no_grad():
        q, k = adapter.project_qk(layer, hidden, captured["rope"], queries)
        scores = visual_attention_scores(q, k, query_positions=queries, scaling=layer.self_attn.scaling)
    eager = out.attentions[layer_index][:, :, queries[0]].mean(dim=(1, 2))
    torch.testing.assert_close(scores, eager.float(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("keep", [1.0, 0.5, 0.33, 0.25, 0.11, 0.01])
def test_kept_count_follows_the_rounding_rule(keep):
    model, processor = _model("llava", "sdpa")
    samples = [("q?", [random_image(120, 90, 1)]), ("q?", [random_image(64, 80, 2), random_image(60, 60, 3)])]
    with vtprune.apply(model, "random", keep=keep, layer=1) as handle, torch.no_grad():
        model(**_inputs("llava", processor, samples))
    stats = handle.last_stats
    assert stats.kept[0] == [vtprune.keep_count(keep, n) for n in stats.visual_tokens]
    assert vtprune.keep_count(0.25, 576) == 144 and vtprune.keep_count(0.11, 576) == 63
    assert vtprune.keep_count(0.5, 5) == 3 and vtprune.keep_count(0.01, 10) == 1


def test_progressive_schedule_and_compact_positions_decode_consistently():
    model, processor = _model("llava", "sdpa")
    inputs = _inputs("llava", processor)
    with vtprune.apply(model, "pdrop", keep=0.25, positions="compact") as handle:
        generated, logits = _generate(model, inputs)
        stats = handle.last_stats
        stages = handle.stages
    assert len(stats.kept) == len(stages) == 3
    assert stats.kept[-1] == [vtprune.keep_count(0.25, stats.visual_tokens[0])]
    weights = torch.zeros(stats.visual_tokens[0])
    for kept in stats.kept_indices:
        weights[torch.tensor(kept[0])] += 1.0
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], generated[:, :-1]], dim=1)
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    with torch.no_grad(), vtprune.apply(model, "oracle", schedule=",".join(f"{s.layer}:{s.keep}" for s in stages),
                                        positions="compact") as handle:
        handle.set_evidence([weights])
        recomputed = model(**full, use_cache=False).logits[:, -generated.shape[1]:]
    torch.testing.assert_close(recomputed, logits, atol=1e-4, rtol=0)


def test_pre_llm_stage_decodes_consistently():
    model, processor = _model("qwen2_vl", "sdpa")
    inputs = _inputs("qwen2_vl", processor)
    with vtprune.apply(model, "random", keep=0.5, layer=0, seed=3) as handle:
        generated, logits = _generate(model, inputs)
        kept = handle.last_stats.kept_indices[0][0]
    weights = torch.zeros(handle.last_stats.visual_tokens[0])
    weights[torch.tensor(kept)] = 1.0
    recomputed = _recompute(model, inputs, generated, [weights], handle.stages)
    torch.testing.assert_close(recomputed, logits, atol=1e-4, rtol=0)


def test_text_only_input_is_a_no_op():
    model, processor = _model("llava", "sdpa")
    ids = processor.tokenizer(["USER: hello there ASSISTANT:"], return_tensors="pt")
    with torch.no_grad():
        reference = model(**ids).logits
        with vtprune.apply(model, "fastv", keep=0.25) as handle:
            pruned = model(**ids).logits
    torch.testing.assert_close(pruned, reference, atol=0, rtol=0)
    assert handle.last_stats is None


def test_exception_inside_generate_leaves_no_hooks():
    model, processor = _model("llava", "sdpa")
    pristine = _hooks(model)
    with pytest.raises(ValueError), vtprune.apply(model, "fastv", keep=0.5):
        model.generate(**_inputs("llava", processor), max_new_tokens=2, bad_argument_xyz=1)
    assert _hooks(model) == pristine
    assert not hasattr(model, "_vtprune_handle")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(method="fastv", keep=0.0), "keep must be in"),
        (dict(method="fastv", keep=1.5), "keep must be in"),
        (dict(method="nonsense", keep=0.5), "known methods: .*fastv"),
        (dict(method="fastv", keep=0.5, layer=9), "outside the language model, which has 4"),
        (dict(method="fastv", keep=0.5, layer=0), "cannot prune before the first decoder layer"),
        (dict(method="fastv", schedule="2:0.5,1:0.25"), "increase strictly"),
        (dict(method="fastv", schedule="2-0.5"), "LAYER:KEEP"),
        (dict(method="fastv+nonsense", keep=0.5), "only '\\+debias'"),
        (dict(method="fastv", keep=0.5, positions="shifted"), "positions must be"),
    ],
)
def test_bad_values_raise_at_wrap_time(kwargs, message):
    model, _ = _model("llava", "sdpa")
    pristine = _hooks(model)
    with pytest.raises(ValueError, match=message):
        vtprune.wrap(model, **kwargs)
    assert _hooks(model) == pristine


def test_model_specific_errors():
    qwen3, _ = _model("qwen3_vl", "sdpa")
    with pytest.raises(ValueError, match="DeepStack"):
        vtprune.wrap(qwen3, "fastv", keep=0.5, layer=1)
    qwen2, _ = _model("qwen2_vl", "sdpa")
    with pytest.raises(ValueError, match="compact"):
        vtprune.wrap(qwen2, "fastv", keep=0.5, positions="compact")
    with pytest.raises(ValueError, match="supported model types: llava"):
        vtprune.wrap(torch.nn.Linear(2, 2), "fastv")
    llava, _ = _model("llava", "sdpa")
    with vtprune.apply(llava, "fastv", keep=0.5), pytest.raises(ValueError, match="already wrapped"):
        vtprune.wrap(llava, "fastv", keep=0.5)


def test_list_methods_has_the_baselines():
    methods = vtprune.list_methods()
    assert {"none", "random", "fastv", "pdrop", "oracle"} <= set(methods)


def test_right_padded_batch_equals_samples_alone():
    model, processor = _model("llava", "sdpa")
    samples = [("what color is the circle?", [random_image(120, 90, 1)]),
               ("how many?", [random_image(64, 80, 2), random_image(90, 60, 3)])]
    processor.tokenizer.padding_side = "right"
    from vtprune.models.tiny import prompt_for

    texts = [prompt_for("llava", q, len(images)) for q, images in samples]
    batch = dict(processor(text=texts, images=[i for _, imgs in samples for i in imgs], return_tensors="pt",
                           padding=True))
    processor.tokenizer.padding_side = "left"
    with vtprune.apply(model, "fastv", keep=0.3, layer=2) as handle, torch.no_grad():
        logits = model(**batch).logits
        stats = handle.last_stats
        lengths = batch["attention_mask"].sum(dim=1)
        for row, sample in enumerate(samples):
            alone = model(**_inputs("llava", processor, [sample])).logits
            last = int(lengths[row]) - 1  # logits come back in the input layout (vtprune.outputs)
            torch.testing.assert_close(logits[row, last], alone[0, -1], atol=1e-4, rtol=0)
            assert handle.last_stats.kept_indices[0][0] == stats.kept_indices[0][row]


@pytest.mark.parametrize("model_type", ["llava_next", "qwen2_vl"])
def test_segments_are_the_same_under_generate(model_type):
    """``generate`` pre-encodes images and drops sizes/grids; adapters recover the same token grids."""
    model, processor = _model(model_type, "sdpa")
    inputs = _inputs(model_type, processor, [("q?", [random_image(120, 90, 0)]), ("q?", [random_image(60, 90, 1)])])
    seen = []

    class SegmentSpy(vtprune.Scorer):  # a user-defined scorer: reads the (lazily computed) segments
        def score(self, ctx):
            seen.append(list(ctx.segments))
            return torch.zeros(ctx.valid.shape)

    handle = vtprune.wrap(model, SegmentSpy(), keep=0.5, layer=2)
    with torch.no_grad():
        model(**inputs)
        model.generate(**inputs, max_new_tokens=1)
    handle.remove()
    assert seen[0] == seen[1]
    assert all(segment.h > 1 for sample in seen[1] for segment in sample)


def test_device_kept_counts_equal_the_host_rules():
    from vtprune.config import keep_count, truncated_count
    from vtprune.plan import device_kept_counts

    n = torch.arange(0, 3000)
    keeps = [1.0, 0.5, 0.33, 0.25, 0.125, 0.11, 0.05, 0.01, 0.875, 0.625, 0.1 + 0.2]
    for counting, rule in (("round", keep_count), ("truncate", truncated_count)):
        device = device_kept_counts(n, keeps, counting)
        host = torch.tensor([[rule(keep, int(v)) for v in n] for keep in keeps])
        assert torch.equal(device, host), counting
