"""What the layer-wise vLLM tests share: requests run through an engine and through vtprune's transformers path,
several decode steps each (end-of-sequence ignored, so every request decodes the same number of steps), and the
comparison of both: token ids, kept visual tokens and every step's log-probabilities."""

from __future__ import annotations

import torch
from reference import prompt

STEPS = 6
TOLERANCE = 1e-3  # float32, vLLM's CPU kernels against transformers' SDPA (measured differences: about 1e-5)


def reference_steps(model, processor, items, method: str | None, keep: float, steps: int = STEPS, **options):
    """Per ``(image or [images], question)``: ``(new token ids, kept visual indices, [per-step log-probabilities
    [V]])`` of vtprune's transformers path (``method=None``: the unwrapped model), greedy, ``steps`` tokens."""
    import vtprune

    handle = vtprune.wrap(model, method, keep=keep, **options) if method else None
    out = []
    try:
        for image, question in items:
            count = len(image) if isinstance(image, list) else 1
            inputs = processor(images=image, text=prompt(processor, question, count), return_tensors="pt")
            with torch.no_grad():
                result = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_scores=True,
                                        return_dict_in_generate=True, eos_token_id=[10 ** 9], pad_token_id=0)
            kept = [int(i) for i in handle.last_stats.kept_indices[-1][0]] if handle is not None else None
            ids = result.sequences[0, inputs["input_ids"].shape[1]:].tolist()
            out.append((ids, kept, [torch.log_softmax(s[0].float(), dim=-1) for s in result.scores]))
    finally:
        if handle is not None:
            handle.remove()
    return out


def engine_steps(llm, items, keep: float | list[float] | None = None, steps: int = STEPS):
    """Per item, from one ``generate`` call (the engine batches and interleaves them as it schedules):
    ``(new token ids, [per-step {token: log-probability} of the top 5])``. ``keep``: every request's, or a list
    (one per item: per-request keeps in one batch)."""
    from vllm import SamplingParams

    keeps = keep if isinstance(keep, list) else [keep] * len(items)
    requests = []
    for (image, question), keep in zip(items, keeps, strict=True):
        count = len(image) if isinstance(image, list) else 1
        request = {"prompt": prompt(llm.get_tokenizer(), question, count), "multi_modal_data": {"image": image}}
        if keep is not None:
            request["mm_processor_kwargs"] = {"vtprune_keep": keep}
        requests.append(request)
    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: p.logprob for t, p in top.items()} for top in o.outputs[0].logprobs])
            for o in outputs]


def step_gap(got, want) -> float:
    """The largest log-probability difference over every step of every request (``inf`` if token ids differ)."""
    worst = 0.0
    for (ids, tops), (want_ids, _, want_steps) in zip(got, want, strict=True):
        if ids != want_ids:
            return float("inf")
        for top, reference in zip(tops, want_steps, strict=True):
            worst = max(worst, max(abs(value - float(reference[token])) for token, value in top.items()))
    return worst


def selections(llm) -> list[list[int]]:
    """The kept visual tokens of every prompt the engine's layer-wise hooks pruned since the last call (then
    forgotten), in the order the prompts' prefills ended."""
    from vtprune.vllm.common import clear_selections, recent_selections

    rows = llm.apply_model(recent_selections)[0]
    llm.apply_model(clear_selections)
    return rows
