"""A LLaVA-OneVision video in vLLM with the plugin (tiny checkpoint, tests/vllm/tiny_folders.py): the pooled frames
and their one newline are one group, as vtprune's OneVision adapter segments a video; keep 1.0 equals the
unpruned transformers model, keep 0.25 keeps the transformers path's rows and gives its answer (one engine)."""

from __future__ import annotations

import numpy as np
import pytest
import reference
from conftest import shutdown

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_folders import llava_onevision_folder

    return str(llava_onevision_folder(tmp_path_factory.mktemp("onevision")))


def prompt(question: str) -> str:
    return f"USER: <video>\n{question} ASSISTANT:"


@pytest.fixture(scope="module")
def expected(folder, clip):
    """vtprune's transformers path: unpruned and divprune 0.25 (token ids, kept indices, first-step log-probs)."""
    import torch

    import vtprune

    frames, question = clip
    model, processor = reference.load_folder(folder)
    inputs = processor(text=prompt(question), videos=[list(frames)], return_tensors="pt")
    out = {}
    for keep in (1.0, 0.25):
        handle = vtprune.wrap(model, "divprune", keep=keep, positions="compact", rounding="per_image") if keep < 1 else None
        try:
            with torch.no_grad():
                result = model.generate(**inputs, max_new_tokens=4, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True)
            kept = [int(i) for i in handle.last_stats.kept_indices[-1][0]] if keep < 1.0 else None
        finally:
            if handle is not None:
                handle.remove()
        ids = result.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        out[keep] = (ids, kept, torch.log_softmax(result.scores[0][0].float(), dim=-1).tolist())
    out["visual"] = int((inputs["input_ids"] == model.config.video_token_id).sum())
    return out


@pytest.fixture(scope="module")
def engine(folder, expected):
    from vllm import LLM

    llm = LLM(folder, enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, max_num_seqs=2,
              limit_mm_per_prompt={"image": 0, "video": 1},
              hf_overrides={"architectures": ["VtpruneLlavaOnevisionForConditionalGeneration"],
                            "vtprune": {"method": "divprune", "keep": 0.25}})
    yield llm
    shutdown(llm)


def run(llm, clip, keep: float) -> dict:
    from vllm import SamplingParams

    from vtprune.vllm.common import clear_selections, recent_selections

    frames, question = clip
    llm.apply_model(clear_selections)
    request = {"prompt": prompt(question), "multi_modal_data": {"video": np.stack([np.asarray(f) for f in frames])},
               "mm_processor_kwargs": {"vtprune_keep": keep}}
    out, = llm.generate([request], SamplingParams(max_tokens=4, temperature=0.0, logprobs=5), use_tqdm=False)
    return {"ids": list(out.outputs[0].token_ids), "length": len(out.prompt_token_ids),
            "top": {t: p.logprob for t, p in out.outputs[0].logprobs[0].items()},
            "kept": llm.apply_model(recent_selections)[0]}


def close(top: dict, reference_logprobs: list[float]) -> bool:
    return max(abs(value - reference_logprobs[token]) for token, value in top.items()) < TOLERANCE


def test_video_keep_one_equals_the_unpruned_model(engine, clip, expected):
    got = run(engine, clip, 1.0)
    assert got["ids"] == expected[1.0][0] and close(got["top"], expected[1.0][2])
    assert got["kept"] == [list(range(expected["visual"]))]


def test_video_quarter_equals_transformers_path(engine, clip, expected):
    from vtprune.config import keep_count

    got = run(engine, clip, 0.25)
    assert got["kept"] == [expected[0.25][1]]
    assert len(got["kept"][0]) == keep_count(0.25, expected["visual"])  # one group: the whole video
    assert got["ids"] == expected[0.25][0] and close(got["top"], expected[0.25][2])
