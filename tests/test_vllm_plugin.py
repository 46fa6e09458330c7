"""The vLLM plugin's pure parts in the main venv (no vLLM here): settings, selection, positions, export, serve.

The engine tests live in tests/vllm and run in the vLLM venv (test.sh); this file checks they stay wired in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import lm_input_embeds

from vtprune.vllm import settings
from vtprune.vllm.positions import fill_chunk, media_runs, prompt_positions
from vtprune.vllm.select import (
    frame_offsets,
    grid_offsets,
    kept_count,
    select_rows,
    truncate_runs,
    visionzip_rows,
)

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_plugin_imports_no_vllm():
    code = "import sys, vtprune, vtprune.vllm, vtprune.vllm.serve; print('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_engine_tests_stay_wired_into_ci():
    assert (ROOT / "tests" / "vllm" / "test_qwen.py").exists()
    script = (ROOT / "test.sh").read_text()
    assert "scripts/setup_vllm.sh" in script and "tests/vllm" in script


@pytest.mark.parametrize("method", ["fastv", "pdrop", "transprune", "ttv", "dart", "fastv+debias", "pdrop+debias",
                                    "transprune+debias"])
def test_layer_wise_methods_served(method):
    assert settings.check_method(method) == method
    assert settings.VllmPruning.from_dict({"method": method, "keep": 0.25}).layer_wise


def test_prefixkv_served_as_kv_retention():
    pruning = settings.VllmPruning.from_dict({"method": "prefixkv", "keep": 0.25, "options": {"query_rows": 64}})
    assert pruning.layer_wise and settings.is_retention("prefixkv") and not settings.is_retention("fastv")
    with pytest.raises(ValueError, match="no stage layer; drop layer=2") as error:
        settings.VllmPruning.from_dict({"method": "prefixkv", "layer": 2})
    assert "\n" not in str(error.value)


def test_methods_the_plugin_cannot_serve_refused_in_one_line_with_the_reason():
    with pytest.raises(ValueError, match="oracle.*not available in the vLLM plugin.*evidence") as error:
        settings.check_method("oracle")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("raw, match", [({"keep": 0}, r"outside \(0, 1\]"), ({"keep": 1.5}, r"outside \(0, 1\]"),
                                        ({"keep": "x"}, "not a number"), ({"method": "dart+debias"}, r"\+debias"),
                                        ({"method": "divprune+debias"}, r"\+debias"),
                                        ({"method": "divprune", "layer": 2}, "layer-wise methods"),
                                        ({"method": "fastv", "layer": 0}, "layer=0 must be an integer >= 1"),
                                        ({"method": "fastv", "layer": True}, "must be an integer"),
                                        ({"method": "fastv", "options": [1]}, "mapping of method options"),
                                        ({"method": "per_frame"}, "not available in the vLLM plugin"),
                                        ({"seed": 1.5}, "integer"), ({"bogus": 1}, "unknown setting"),
                                        ({"method": "divprune", "count": "evs"}, "with method 'temporal'"),
                                        ({"method": "temporal", "count": "x"}, "count='x'")])
def test_bad_settings_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        settings.VllmPruning.from_dict(raw)


@pytest.mark.parametrize("kwargs, match", [({"vtprune_keep": True}, "not a number"),
                                           ({"vtprune_keep": "0.5"}, "not a number"),
                                           ({"vtprune_keep": 0.0}, r"outside \(0, 1\]"),
                                           ({"vtprune_kep": 0.5}, "unknown request key.*'vtprune_kep'"),
                                           ({"keep": 0.5}, "unknown request key.*'keep'"),
                                           ({"VTPRUNE_KEEP": 0.5}, "unknown request key")])
def test_bad_request_keep_refused(kwargs, match):
    """A request's keep is applied or the request is refused: never silently run at the model's keep."""
    pruning = settings.VllmPruning.from_dict({"keep": 0.25})
    with pytest.raises(ValueError, match=match) as error:
        pruning.request_keep(kwargs)
    assert "\n" not in str(error.value)
    assert pruning.request_keep({"vtprune_keep": 0.5, "max_pixels": 1000}) == 0.5
    assert pruning.request_keep({}) == 0.25


def test_architectures_and_versions():
    assert settings.check_architecture("Qwen2VLForConditionalGeneration") == "VtpruneQwen2VLForConditionalGeneration"
    for family in ("LlavaNext", "LlavaOnevision", "Qwen3VL"):
        assert settings.check_architecture(f"{family}ForConditionalGeneration") == f"Vtprune{family}ForConditionalGeneration"
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*not supported in vLLM"):
        settings.check_architecture("Gemma3ForConditionalGeneration")
    for version in ("0.31.0", "0.31.2", "0.32.0", "0.33.0", "0.33.1.dev4+g1a2b3c"):  # the tested minors, any patch
        assert settings.check_vllm_version(version) == version
    for version in ("0.30.1", "0.34.0", "1.32.0"):  # each refusal names the tested set
        with pytest.raises(ValueError, match=r"vLLM .* is outside the tested set \(0\.31, 0\.32, 0\.33;"):
            settings.check_vllm_version(version)


def lm_inputs(family: str):
    """The unwrapped embedded model's LLM-input embeddings of one test image's visual tokens ``[n, D]``."""
    from vtprune.models.loading import load
    from vtprune.shapes.task import make_split

    model, processor = load(f"embedded:{family}")[:2]
    sample = make_split("test", 1, offset=3)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(images=sample.image, text=text, return_tensors="pt")
    embeds = lm_input_embeds(model, inputs)
    token = model.config.image_token_id if hasattr(model.config, "image_token_id") else model.config.image_token_index
    visual = inputs["input_ids"][0] == token
    return model, inputs, embeds[0, visual]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("method", ["divprune", "random"])
def test_selection_equals_transformers_path(family, method):
    import vtprune

    model, inputs, embeddings = lm_inputs(family)
    options = {"layer": 0} if method == "random" else {}  # in vLLM every method runs before the LLM
    handle = vtprune.wrap(model, method, keep=0.25, **options)
    with torch.no_grad():
        model(**inputs)
    want = handle.last_stats.kept_indices[-1][0]
    handle.remove()
    assert select_rows(method, embeddings, 0.25).tolist() == want


def llava_tower_layer(method: str, **options) -> tuple:
    """The embedded LLaVA's projector feature layer, its input ``[1, T, D]`` and the image's LLM-input rows
    ``[n, D]`` during one forward of vtprune's transformers path with ``method``, and the rows that path kept."""
    import vtprune
    from vtprune.methods import vit

    model, inputs, embeddings = lm_inputs("llava")
    layer = vit.encoder_layers(model.model)[vit.feature_layer_index(model.model)]
    grabbed = []
    hook = layer.register_forward_pre_hook(lambda module, args: grabbed.append(args[0]))
    handle = vtprune.wrap(model, method, **options)
    try:
        with torch.no_grad():
            model(**inputs)
        want = handle.last_stats.kept_indices[-1][0]
    finally:
        handle.remove()
        hook.remove()
    return layer, grabbed[0], embeddings, want


def test_visionzip_rows_equal_transformers_path():
    """The plugin's VisionZip on the tower maps and LLM inputs of one image keeps vtprune's rows (dominant +
    contextual targets), and the merged contextual row is the mean of the rows merged into it."""
    from vtprune.methods import vit

    layer, hidden, embeddings, want = llava_tower_layer("visionzip", keep=0.25, positions="compact")
    with torch.no_grad():
        attention = vit.vit_attention(layer, hidden)[0, 0, 1:]
        keys = layer.self_attn.k_proj(layer.layer_norm1(hidden))[0, 1:]
    keys = keys.view(keys.shape[0], int(layer.self_attn.num_heads), -1).mean(dim=1)
    rows, values = visionzip_rows(attention, keys, embeddings, 0.25)
    assert rows.tolist() == want
    assert len(rows) == kept_count(0.25, embeddings.shape[0], method="visionzip") == 4
    dominant = torch.sort(-attention, stable=True).indices[:3]
    target = sorted(set(rows.tolist()) - set(dominant.tolist()))[0]
    merged = [i for i in range(embeddings.shape[0]) if i not in dominant.tolist()]
    assert target == merged[0]
    assert torch.allclose(values[rows.tolist().index(target)], embeddings[merged].mean(dim=0), atol=1e-5)


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_random_multi_image_rows_equal_transformers_path_per_image(model_type):
    """Two images in one prompt: under ``rounding="per_image"`` the transformers path's ``random`` (pre-LLM)
    draws each image's own values and keeps its own share, the rows the plugin keeps image by image."""
    import vtprune
    from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

    model, processor = tiny_model(model_type)
    images = [random_image(64, 64, 1), random_image(96, 64, 2)]
    inputs = tiny_inputs(processor, model_type, [("how many?", images)])
    token = model.config.image_token_id
    handle = vtprune.wrap(model, "random", keep=0.28, layer=0, rounding="per_image", seed=3)
    with torch.no_grad():
        model(**inputs)
    want = handle.last_stats.kept_indices[-1][0]
    segments = handle.adapter.segments(inputs["input_ids"], inputs)[0]
    handle.remove()
    sizes = [segment.length for segment in segments]
    assert sum(sizes) == int((inputs["input_ids"] == token).sum()) and len(sizes) == 2
    rows, start = [], 0
    for size in sizes:  # the plugin: each image alone (its rows' values do not matter to random)
        rows += (select_rows("random", torch.zeros(size, 4), 0.28, seed=3) + start).tolist()
        start += size
    assert want == rows
    assert len(want) == sum(kept_count(0.28, n) for n in sizes)


def test_vflowopt_rows_equal_transformers_path():
    """The plugin's VFlowOpt (pre-LLM stage, no recycling) on the tower map of one image keeps the transformers
    path's rows: context relevance at the release's threshold scaled to the tower, CLS dropped, top keep."""
    from vtprune.methods import vit
    from vtprune.vllm.select import top_rows

    layer, hidden, embeddings, want = llava_tower_layer("vflowopt", schedule="0:0.25", recycle=False,
                                                        positions="compact")
    with torch.no_grad():
        maps = vit.vit_attention(layer, hidden)
    relevance = vit.context_relevance(maps, 35.0 * maps.shape[-1] / 730)[0, 1:]  # T = 17 tokens, CLS dropped
    assert top_rows(relevance, 0.25).tolist() == want
    assert len(want) == kept_count(0.25, embeddings.shape[0], method="vflowopt") == 4
    assert top_rows(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0.5).tolist() == [1, 2]  # ties: the earlier row


def test_selection_is_a_pure_function_of_inputs_and_seed():
    embeddings = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    first = select_rows("divprune", embeddings, 0.25)
    torch.manual_seed(123)
    assert torch.equal(select_rows("divprune", embeddings.clone(), 0.25), first)
    assert torch.equal(select_rows("random", embeddings, 0.25, seed=3), select_rows("random", embeddings * 2, 0.25,
                                                                                     seed=3))
    assert not torch.equal(select_rows("random", embeddings, 0.25, seed=3), select_rows("random", embeddings, 0.25))
    assert select_rows("divprune", embeddings, 0.25, frames=4).numel() == kept_count(0.25, 64, 4) == 16


def test_temporal_keeps_the_first_frame_then_the_changed_rows():
    """4 frames of 8 rows, each a copy of the previous except rows 2 (frame 1) and 5 (frame 3): at keep 10/32 the
    video keeps frame 0 whole and the two changed rows (vtprune's rule: one budget over the whole video)."""
    first = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    frames = [first, first.clone(), None, None]
    frames[1][2] = -first[2]
    frames[2] = frames[1].clone()
    frames[3] = frames[2].clone()
    frames[3][5] = -first[5]
    video = torch.cat(frames)
    assert kept_count(10 / 32, 32, 4, "temporal") == 10 != kept_count(10 / 32, 32, 4)
    assert select_rows("temporal", video, 10 / 32, frames=4).tolist() == [*range(8), 8 + 2, 24 + 5]
    assert kept_count(0.25, 16, 1, "temporal") == 16  # an image has no previous frame: kept whole
    assert select_rows("temporal", first, 0.25).tolist() == list(range(8))
    # vLLM's EVS count: never below one frame, int() of the rest (tests/vllm/test_evs_parity.py checks the rows)
    assert kept_count(0.1, 32, 4, "temporal_evs") == 8 and kept_count(0.1, 32, 4, "temporal") == 3
    assert kept_count(0.3, 32, 4, "temporal_evs") == 9 != kept_count(0.3, 32, 4, "temporal") == 10
    assert settings.VllmPruning.from_dict({"method": "temporal", "count": "evs"}).selection == "temporal_evs"


def unpruned_positions(text_before: int, grid: tuple[int, int, int], text_after: int) -> torch.Tensor:
    """Qwen2-VL's unpruned positions, written out by hand: ``[3, L]``."""
    t, h, w = grid
    rows = [[i, i, i] for i in range(text_before)]
    rows += [[text_before + a, text_before + b, text_before + c] for a in range(t) for b in range(h) for c in range(w)]
    start = text_before + max(t, h, w)
    rows += [[start + i] * 3 for i in range(text_after)]
    return torch.tensor(rows).T


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 64])
def test_positions_equal_the_unpruned_ones_at_the_kept_tokens_for_any_chunking(chunk):
    grid, before, after = (1, 3, 5), 3, 4
    kept = torch.tensor([0, 4, 7, 11, 14])
    full = unpruned_positions(before, grid, after)
    keep_columns = torch.cat([torch.arange(before), before + kept, before + 15 + torch.arange(after)])
    want = full[:, keep_columns]
    length = before + len(kept) + after
    positions, delta = prompt_positions(length, [(before, len(kept), max(grid))])
    media = torch.zeros(length, dtype=torch.bool)
    media[before:before + len(kept)] = True
    offsets = grid_offsets(grid)[kept]
    for start in range(0, length, chunk):  # vLLM passes the slice of the item inside each chunk
        lo, hi = max(start, before), min(start + chunk, before + len(kept))
        slices = [offsets[lo - before:hi - before]] if lo < hi else []
        positions = fill_chunk(positions, media, slices, start)
    assert torch.equal(positions, want)
    assert delta == int(want.max()) + 1 - length


def test_truncate_runs_keeps_each_frames_share_and_every_timestamp():
    V, S, E = 9, 7, 8  # video token, <|vision_start|>, <|vision_end|>
    frame = [1, 2, S] + [V] * 6 + [E]  # a two-token timestamp, then one frame of 6 tokens
    assert truncate_runs(frame * 2, V, 0.5) == ([1, 2, S] + [V] * 3 + [E]) * 2
    assert truncate_runs(frame, V, 0.01) == [1, 2, S, V, E]  # at least one token per frame
    assert truncate_runs(frame * 3, V, 1.0) == frame * 3


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 7, 64])
def test_qwen3_video_positions_equal_the_unpruned_ones_for_any_chunking(chunk):
    """A Qwen3-VL video, written out by hand: per frame a 2-token timestamp, <|vision_start|>, a 2 x 3 frame
    numbered (0, y, x) from its own base, <|vision_end|>; text continues at base + max(h, w)."""
    before, after, frames, (h, w) = 2, 3, 3, (2, 3)
    kept = [[0, 4], [1, 2, 5], [3]]  # each frame's kept tokens (a frame keeps at least one)
    full, pruned, media, cursor = [], [], [], 0
    for _ in range(before):
        full.append([cursor] * 3), pruned.append(True), media.append(False)
        cursor += 1
    for frame in range(frames):
        for _ in range(3):  # the timestamp's two tokens and <|vision_start|>
            full.append([cursor] * 3), pruned.append(True), media.append(False)
            cursor += 1
        for index in range(h * w):
            full.append([cursor, cursor + index // w, cursor + index % w])
            pruned.append(index in kept[frame]), media.append(True)
        cursor += max(h, w)
        full.append([cursor] * 3), pruned.append(True), media.append(False)  # <|vision_end|>
        cursor += 1
    for _ in range(after):
        full.append([cursor] * 3), pruned.append(True), media.append(False)
        cursor += 1
    columns = torch.tensor(pruned)
    want = torch.tensor(full).T[:, columns]
    short_media = torch.tensor(media)[columns]
    runs = [(start, end - start, max(h, w)) for start, end in media_runs(short_media)]
    positions, delta = prompt_positions(len(want[0]), runs)
    offsets = frame_offsets((frames, h, w))[torch.tensor([f * h * w + i for f in range(frames) for i in kept[f]])]
    assert offsets[:, 0].eq(0).all()
    rank = torch.cumsum(short_media.long(), 0) - short_media.long()  # row of each placeholder
    for start in range(0, want.shape[1], chunk):  # vLLM passes the video's rows inside each chunk
        inside = short_media[start:start + chunk].nonzero().flatten() + start
        slices = [offsets[int(rank[inside[0]]):int(rank[inside[-1]]) + 1]] if len(inside) else []
        positions = fill_chunk(positions, short_media, slices, start)
    assert torch.equal(positions, want)
    assert delta == int(want.max()) + 1 - want.shape[1]


def test_exported_llava_loads_to_an_identical_state_dict(tmp_path):
    from transformers import LlavaForConditionalGeneration

    from vtprune.models.embedded import embedded_model_path
    from vtprune.vllm.export import export_embedded, llava_hf_names

    folder = export_embedded("llava", root=tmp_path)
    assert export_embedded("llava", root=tmp_path) == folder  # cached
    original = LlavaForConditionalGeneration.from_pretrained(embedded_model_path("llava")).state_dict()
    exported = LlavaForConditionalGeneration.from_pretrained(folder).state_dict()
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert llava_hf_names(["vision_tower.embeddings.x", "language_model.y"]) == {
        "vision_tower.embeddings.x": "vision_tower.vision_model.embeddings.x", "language_model.y": "language_model.y"}
    # transformers 5 saves a LLaVA-family model under model.*: the tower moves, nothing else does
    assert llava_hf_names(["model.vision_tower.embeddings.x", "model.vision_tower.vision_model.y", "model.image_newline"]
                          ) == {"model.vision_tower.embeddings.x": "model.vision_tower.vision_model.embeddings.x",
                                "model.vision_tower.vision_model.y": "model.vision_tower.vision_model.y",
                                "model.image_newline": "model.image_newline"}


def test_tile_groups_budget_base_view_and_tiles_apart():
    """A LLaVA-NeXT / OneVision image: the base view (side x side) and the tile grid keep their own shares."""
    from types import SimpleNamespace

    from vtprune.config import keep_count
    from vtprune.vllm.select import frame_sizes, image_groups, kept_count

    vision = SimpleNamespace(image_size=336, patch_size=14, model_type="clip_vision_model")
    config = SimpleNamespace(vision_config=vision, vision_feature_select_strategy="default")
    assert image_groups(config, 576 + 1200) == [576, 1200]
    assert image_groups(config, 576) == [576]
    assert image_groups(SimpleNamespace(vision_config=vision, vision_feature_select_strategy="full"), 1777) == [1777]
    assert kept_count(0.1, 576 + 1200, [576, 1200]) == keep_count(0.1, 576) + keep_count(0.1, 1200) == 58 + 120
    assert frame_sizes(10, [4, 6]) == [4, 6]
    with pytest.raises(ValueError, match="do not split"):
        frame_sizes(10, [4, 5])
    with pytest.raises(ValueError, match="equal frames"):
        kept_count(0.5, 10, [4, 6], "temporal")
    # divprune per group: the picks of each group are its own max-min order, offset by the group's start
    from vtprune.methods.divprune import cosine_distance, max_min_order

    rows = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    kept = select_rows("divprune", rows, 0.5, [4, 6]).tolist()
    base = sorted(max_min_order(cosine_distance(rows[:4]), 2).tolist())
    tiles = sorted((max_min_order(cosine_distance(rows[4:]), 3) + 4).tolist())
    assert kept == base + tiles
