"""LLaVA-NeXT, LLaVA-OneVision (tile budgets), Qwen3-VL (DeepStack) and Qwen2.5-VL (windowed ViT) in vLLM with the plugin, on tiny
random-weight checkpoints that vLLM and transformers load from the same folder (tests/vllm/tiny_folders.py).

Per family: stock vLLM equals transformers; the pruned engine at keep 1.0 equals stock vLLM; at keep 0.25 the
kept rows, greedy answers and first-step log-probabilities equal vtprune's transformers path (NeXT / OneVision
with ``rounding="per_image"``: the base view and the tile grid keep their own shares; Qwen3-VL at its pre-LLM
stage, DeepStack rows dropped with their tokens, original M-RoPE positions), with chunked prefill and prefix
caching on; images of several aspect ratios (different tile grids), two images per prompt. Qwen-VL video (Qwen3-VL: a
timestamp before every frame): each frame keeps its share, as the transformers path with ``rounding="per_image"``;
an image and a video in one prompt.
"""

from __future__ import annotations

import pytest
import reference
from conftest import shutdown

FAMILIES = {  # family -> (pruned architecture, transformers-path options, prefill chunk)
    "llava_next": ("VtpruneLlavaNextForConditionalGeneration", {"rounding": "per_image", "positions": "compact"}, 5),
    "llava_onevision": ("VtpruneLlavaOnevisionForConditionalGeneration",
                        {"rounding": "per_image", "positions": "compact"}, 5),
    "qwen3_vl": ("VtpruneQwen3VLForConditionalGeneration", {}, 3),
    "qwen2_5_vl": ("VtpruneQwen2_5_VLForConditionalGeneration", {}, 3),
}
QWEN = ("qwen3_vl", "qwen2_5_vl")
SIZES = [(112, 112), (200, 112), (112, 190)]  # width x height: tile grids 2x2, 1x2, 2x1 (NeXT)
TOLERANCE = 1e-3
#: stock vLLM's Qwen2.5-VL video itself differs from transformers by up to 4e-3 here (measured; images < 1e-3)
VIDEO_TOLERANCE = {"qwen3_vl": TOLERANCE, "qwen2_5_vl": 1e-2}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from tiny_folders import BUILDERS

    name = request.param
    return name, str(BUILDERS[name](tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="module")
def samples(items):
    """Three (image, question) pairs at the three sizes, and a two-image prompt."""
    chosen = [(image.resize(size), question) for (image, question), size in zip(items, SIZES)]
    return chosen + [([chosen[1][0], chosen[2][0]], chosen[0][1])]


def engine(folder: str, pruned: str | None = None, video: int = 0, **options):
    from vllm import LLM

    settings = dict(enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, max_num_seqs=4,
                    limit_mm_per_prompt={"image": 2, "video": video})
    if pruned:
        settings["hf_overrides"] = {"architectures": [pruned], "vtprune": {"method": "divprune", "keep": 0.25}}
    settings.update(options)
    return LLM(folder, **settings)


def run(llm, samples, keep=None, logprobs: int = 5) -> list[dict]:
    """Per request (one at a time): new token ``ids``, prompt ``length``, ``visual`` placeholders, ``cached``
    prompt tokens and ``top``, the first step's ``{token: log-probability}``."""
    from vllm import SamplingParams

    from vtprune.vllm.common import clear_selections

    config = llm.llm_engine.model_config.hf_config
    media = {getattr(config, name, None) for name in ("image_token_id", "image_token_index")} - {None}
    rows = []
    llm.apply_model(clear_selections)
    for image, question in samples:
        count = len(image) if isinstance(image, list) else 1
        request = {"prompt": reference.prompt(llm.get_tokenizer(), question, count),
                   "multi_modal_data": {"image": image}}
        if keep is not None:
            request["mm_processor_kwargs"] = {"vtprune_keep": keep}
        out, = llm.generate([request], SamplingParams(max_tokens=4, temperature=0.0, logprobs=logprobs),
                            use_tqdm=False)
        rows.append({"ids": list(out.outputs[0].token_ids), "length": len(out.prompt_token_ids),
                     "visual": sum(token in media for token in out.prompt_token_ids),
                     "cached": out.num_cached_tokens or 0,
                     "top": {t: p.logprob for t, p in out.outputs[0].logprobs[0].items()}})
    return rows


@pytest.fixture(scope="module")
def expected(family, samples):
    """vtprune's transformers path on the same folder: unpruned and divprune 0.25 (ids, kept, log-probs)."""
    name, folder = family
    model, processor = reference.load_folder(folder)
    options = FAMILIES[name][1]
    return {1.0: reference.answers(model, processor, samples, None, 1.0, logprobs=True),
            0.25: reference.answers(model, processor, samples, "divprune", 0.25, logprobs=True, **options)}


@pytest.fixture(scope="module")
def stock(family, samples, expected):
    llm = engine(family[1])
    try:
        return run(llm, samples)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def pruned(family, stock):
    name, folder = family
    chunk = FAMILIES[name][2]
    llm = engine(folder, FAMILIES[name][0], video=int(name in QWEN), enable_prefix_caching=True,
                 enable_chunked_prefill=True,
                 max_num_batched_tokens=chunk, max_num_seqs=chunk, block_size=32)
    yield llm
    shutdown(llm)


def close(top: dict, reference_logprobs: list[float], tolerance: float = TOLERANCE) -> bool:
    return max(abs(value - reference_logprobs[token]) for token, value in top.items()) < tolerance


def test_stock_vllm_equals_transformers(stock, expected):
    assert [row["ids"] for row in stock] == [ids for ids, _, _ in expected[1.0]]
    assert all(close(row["top"], want) for row, (_, _, want) in zip(stock, expected[1.0]))


def test_keep_one_equals_stock(pruned, samples, stock):
    got = run(pruned, samples, keep=1.0)
    assert [(row["ids"], row["length"]) for row in got] == [(row["ids"], row["length"]) for row in stock]


def test_quarter_equals_transformers_path(family, pruned, samples, stock, expected):
    from vtprune.config import keep_count
    from vtprune.vllm.common import recent_selections

    got = run(pruned, samples, keep=0.25)
    chosen = pruned.apply_model(recent_selections)[0]
    want = expected[0.25]
    assert [row["ids"] for row in got] == [ids for ids, _, _ in want]
    assert all(close(row["top"], reference_logprobs) for row, (_, _, reference_logprobs) in zip(got, want))
    singles = chosen[:3]
    assert singles == [kept for _, kept, _ in want[:3]]
    # the two-image prompt repeats images 1 and 2 at the same keep: vLLM's encoder cache serves their rows (no
    # new selection), and the transformers path keeps the same rows of each (ordinals over the prompt's tokens)
    assert len(chosen) == 3
    assert singles[1] + [stock[1]["visual"] + i for i in singles[2]] == want[3][1]
    for row, full, kept in zip(got, stock, singles):
        assert row["visual"] == len(kept) and row["length"] == full["length"] - full["visual"] + len(kept)
        n = full["visual"]  # NeXT / OneVision: a 4 x 4 base view, then the tile grid (its own share)
        assert len(kept) == (keep_count(0.25, 16) + keep_count(0.25, n - 16) if family[0] not in QWEN
                             else keep_count(0.25, n))


def test_prefix_cache_serves_each_keep_its_own_rows(pruned, samples, stock):
    image, question = samples[0]
    item = [(image, " ".join([question] * 8))]  # long enough to fill a 32-token block after the image
    first, full, again = (run(pruned, item, keep=keep)[0] for keep in (0.25, 1.0, 0.25))
    assert (first["ids"], first["visual"]) == (again["ids"], again["visual"])
    assert full["visual"] == stock[0]["visual"] > first["visual"]
    assert again["cached"] >= 32  # the repeat hit the prefix cache (its own keep's blocks)


def run_media(llm, question: str, frames, image=None, keep: float = 0.25) -> tuple[list[int], dict, int]:
    """New token ids, the first step's ``{token: log-probability}`` and the prompt length of an (optional) image
    and a video (the prompt of :func:`reference.media_prompt`)."""
    import numpy as np
    from vllm import SamplingParams

    video = (np.stack([np.asarray(f) for f in frames]), dict(reference.video_metadata(len(frames)),
                                                             do_sample_frames=False))
    data = {"video": video} | ({"image": image} if image is not None else {})
    request = {"prompt": reference.media_prompt(llm.get_tokenizer(), question, image is not None),
               "multi_modal_data": data, "mm_processor_kwargs": {"vtprune_keep": keep}}
    out, = llm.generate([request], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5), use_tqdm=False)
    return list(out.outputs[0].token_ids), {t: p.logprob for t, p in out.outputs[0].logprobs[0].items()}, len(
        out.prompt_token_ids)


@pytest.mark.parametrize("family", QWEN, indirect=True)
def test_qwen_video_equals_transformers_path(family, pruned, clip, samples):
    """Each frame (temporal patch) keeps its own quarter (Qwen3-VL: between its timestamps; Qwen2.5-VL: at its
    scaled temporal position); keep 1.0 is the unpruned model; an image before the video keeps its own share and
    the video's rows still get their frames' positions."""
    from vtprune.vllm.common import clear_selections, recent_selections

    frames, question = clip
    folder = family[1]
    image = samples[1][0].resize((150, 120))  # an image no earlier request encoded (encoder cache)
    model, processor = reference.load_folder(folder)
    full = reference.media_answers(model, processor, question, frames)
    want = reference.media_answers(model, processor, question, frames, method="divprune", keep=0.25,
                                   rounding="per_image")
    tolerance = VIDEO_TOLERANCE[family[0]]
    ids, top, length = run_media(pruned, question, frames, keep=1.0)
    assert ids == full[0] and close(top, full[2], tolerance)
    pruned.apply_model(clear_selections)
    ids, top, short = run_media(pruned, question, frames)
    assert ids == want[0] and close(top, want[2], tolerance)
    assert pruned.apply_model(recent_selections)[0] == [want[1]]
    assert length - short == 64 - 16  # 4 frames of 4 x 4 tokens keep 4 each (Qwen3-VL: every timestamp stays)
    both = reference.media_answers(model, processor, question, frames, image, method="divprune", keep=0.25,
                                   rounding="per_image")
    ids, top, _ = run_media(pruned, question, frames, image)
    assert ids == both[0] and close(top, both[2], tolerance)


VIDEO = {"limit_mm_per_prompt": {"image": 1, "video": 1}}


@pytest.mark.parametrize(("name", "method", "options", "message"), [
    ("qwen3_vl", "temporal", VIDEO, "which the plugin does for Qwen2-VL / Qwen2.5-VL video only"),
    ("qwen3_vl", "divprune", VIDEO | {"video_pruning_rate": 0.5}, "turns on vLLM's own video pruning (EVS)"),
    ("llava_next", "temporal", {}, "which the plugin does for Qwen2-VL / Qwen2.5-VL video only"),
    ("llava_onevision", "visionzip", {}, "inside vLLM's tower for LLaVA-1.5 and Qwen-VL only"),
    ("llava_next", "vflowopt", {}, "inside vLLM's tower for LLaVA-1.5 and Qwen-VL only"),
])
def test_unsupported_combinations_refused_at_start(name, method, options, message, tmp_path, capfd):
    from tiny_folders import BUILDERS
    from vllm import LLM

    folder = str(BUILDERS[name](tmp_path))
    settings = {"limit_mm_per_prompt": {"image": 1, "video": 0}} | options
    with pytest.raises(Exception) as error:
        LLM(folder, enforce_eager=True, dtype="float32", max_model_len=1024,
            hf_overrides={"architectures": [FAMILIES[name][0]], "vtprune": {"method": method, "keep": 0.25}},
            **settings)
    assert message in str(error.value) + "".join(capfd.readouterr())
