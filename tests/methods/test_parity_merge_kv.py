"""``parity="release"`` for VisionZip's contextual tokens and PrefixKV's per-layer counts.

References: the values and counts are computed by hand here (VisionZip: ``target + sum(others) / count``;
PrefixKV: the release's bisection written out step by step), and through the engine they are compared with a
literal transcription of the release's ``obtain_cdf_num`` run on the **unwrapped** model's attention maps
(``output_attentions``), which shares no code with vtprune.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from cases import two_samples

import vtprune
from vtprune.methods.prefixkv import counts_from_ratios, layer_budgets, release_evictions, release_kept
from vtprune.methods.visionzip import contextual_merge
from vtprune.models.tiny import tiny_inputs, tiny_model


# -- VisionZip ---------------------------------------------------------------------------------------------------
def test_contextual_value_of_the_release_is_target_plus_the_mean_of_the_others():
    hidden = torch.tensor([[1.0], [3.0], [5.0]])  # one target (the first remainder token) and two merged into it
    keys = torch.ones(3, 2)
    assert contextual_merge(hidden, keys, 1, "mean")[1].item() == 3.0  # (1 + 3 + 5) / 3: vtprune's default
    assert contextual_merge(hidden, keys, 1, "release")[1].item() == 5.0  # 1 + (3 + 5) / 2: the release
    # Two targets (remainder slots 0 and 2); both other tokens join target 0, target 2's group is only itself.
    hidden = torch.tensor([[1.0, 2.0], [3.0, 0.0], [7.0, 7.0], [5.0, 4.0]])
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
    index, merged = contextual_merge(hidden, keys, 2, "release")
    assert index.tolist() == [0, 2]
    assert merged.tolist() == [[1.0 + 4.0, 2.0 + 2.0], [7.0, 7.0]]
    _, plain = contextual_merge(hidden, keys, 2, "mean")
    assert plain.tolist() == [[3.0, 2.0], [7.0, 7.0]]


def _lm_input(model, inputs) -> torch.Tensor:
    """The hidden states entering decoder layer 0 ``[L', D]`` (sample 0) of one forward."""
    seen = {}
    layer = model.model.language_model.layers[0]
    def grab(module, args, kwargs):
        seen["h"] = args[0] if args else kwargs["hidden_states"]

    hook = layer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        hook.remove()
    return seen["h"][0].clone()


def test_visionzip_release_parity_changes_only_the_contextual_values():
    model, processor = tiny_model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava")[:1])
    original = _lm_input(model, inputs)
    image = (inputs["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    first, count = int(image[0]), image.numel()
    runs = {}
    for parity in ("default", "release"):
        with vtprune.apply(model, "visionzip", keep=0.5, parity=parity) as handle:
            pruned = _lm_input(model, inputs)
            kept = handle.last_stats.kept_indices[0][0]
        assert handle.scorer.context_value == ("release" if parity == "release" else "mean")
        assert handle.scorer.queries == ("all" if parity == "release" else "auto")  # the exact map, as released
        runs[parity] = (kept, pruned[first:first + len(kept)])
    assert runs["default"][0] == runs["release"][0]  # same selection
    kept = runs["default"][0]
    target = original[first + torch.tensor(kept)]
    mean, release = runs["default"][1], runs["release"][1]
    contextual = (mean != target).any(dim=1)
    assert contextual.any() and torch.equal(contextual, (release != target).any(dim=1))
    assert torch.equal(mean[~contextual], target[~contextual]) and torch.equal(release[~contextual], target[~contextual])
    # Per contextual token with c merged tokens of sum S: mean = (t + S) / (c + 1), release = t + S / c, so
    # c = (t - mean) / (mean - release + t) must be the same whole number >= 1 in every channel.
    for t, m, r in zip(target[contextual].double(), mean[contextual].double(), release[contextual].double(), strict=True):
        c = (t - m) / (m - r + t)
        assert c.min() > 0.5 and (c - c.round()).abs().max() < 1e-3 and c.max() - c.min() < 1e-3, c
        assert c.round()[0] <= count


# -- PrefixKV: hand-computed counts ------------------------------------------------------------------------------
def test_prefixkv_release_counts_by_hand():
    # Layer A: one token holds 17/32 of the priority, 15 hold 1/32; layer B: 16 tokens of 1/16 (exact in fp32).
    # L = 16 tokens, protect = 2 (start 1 + the last), ratio 0.25 -> target 0.25 * 16 * 2 = 8 evictions.
    # p = 0.5: A has 0 shares < 0.5 -> evicts 16 - 1 - 2 = 13; B has 7 (1/16..7/16) -> 16 - 8 - 2 = 6: 19, too many.
    # p = 0.75: A has 7 (17/32..23/32) -> 16 - 8 - 2 = 6; B has 11 -> 16 - 12 - 2 = 2: 8, the target. Rescale 8/8.
    priority = np.array([[17.0] + [1.0] * 15, [2.0] * 16])
    assert release_evictions(priority, 0.25, 2).tolist() == [6, 2]
    assert release_kept(16, 14, 0.75, priority=priority) == [8, 12]
    # vtprune's default keeps 0.75 of the 14 evictable tokens per layer on average, searched to the token: 21.
    assert sum(layer_budgets(priority[:, 1:-1], 0.75)) == 21
    # Stopped within 5 of the target, then rescaled and truncated: p = 0.5 evicts [3, 2] of the target 6 (5 is
    # within 5), rescaled to [3.6, 2.4] -> [3, 2].
    six = np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.3, 0.3, 0.2, 0.1, 0.05, 0.05]])
    assert release_evictions(six, 0.5, 2).tolist() == [3, 2]
    # With a profile: round(r * L) evicted over the whole prompt (half to even), vtprune: floor(r * n + 0.5) of n.
    assert release_kept(10, 8, 0.5, ratios=[0.25, 0.5]) == [8 - 2, 8 - 5]
    assert counts_from_ratios([0.25, 0.5], 8) == [6, 4]


# -- PrefixKV: through the engine, against the release's search on the unwrapped model's attention ---------------
def release_search(score_sum: torch.Tensor, target_num: float, protect: int) -> np.ndarray:
    """The release's ``obtain_cdf_num`` transcribed (THU-MIG/PrefixKV ``prefixkv.py``), then its rescale."""
    curves = []
    for score in score_sum:
        ordered = score.sort(descending=True).values
        curves.append((ordered / ordered.sum()).cumsum(dim=0))
    curves = torch.stack(curves)
    left, right, mid = 0.0, 1.0, 0.0
    while left < right:
        mid = (left + right) / 2.0
        index = torch.searchsorted(curves, torch.full((curves.size(0), 1), mid), right=False)
        count = (curves.shape[-1] - (index.squeeze(-1) + 1) - protect).clamp(min=0).sum()
        if abs(count - target_num) < 5:
            break
        if count < target_num:
            right = mid
        else:
            left = mid
    index = torch.searchsorted(curves, torch.full((curves.size(0), 1), mid), right=False)
    forget = (curves.shape[-1] - (index.squeeze(-1) + 1) - protect).clamp(min=0).numpy()
    if forget.sum() != 0:
        forget = forget * target_num / forget.sum()
    return forget.astype(np.int32)


def _prompt_and_cache(model, inputs):
    with torch.no_grad():
        out = model(**inputs, use_cache=True)
    return [layer.keys.shape[2] for layer in out.past_key_values.layers]


@pytest.mark.parametrize("keep", [0.5, 0.2])
def test_prefixkv_release_parity_evicts_the_release_counts(keep):
    model, processor = tiny_model("llava", "eager")
    inputs = tiny_inputs(processor, "llava", two_samples("llava")[:1])
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        attentions = model(**inputs, output_attentions=True).attentions
    score_sum = torch.stack([a.float().mean(dim=1)[0].sum(dim=0) for a in attentions])  # [layers, L]
    start = 1
    forget = release_search(score_sum, length * len(attentions) * (1 - keep), start + 1)
    with vtprune.apply(model, "prefixkv", keep=keep, scope="prompt", start=start, parity="release"):
        lengths = _prompt_and_cache(model, inputs)
    assert lengths == [length - int(f) for f in forget]
    with vtprune.apply(model, "prefixkv", keep=keep, scope="prompt", start=start):
        default = _prompt_and_cache(model, inputs)
    assert sum(default) - 2 * len(default) == round(keep * len(default) * (length - 2))  # vtprune's exact budget
    assert sum(lengths) < sum(default)


def test_prefixkv_release_parity_with_a_profile_evicts_round_r_times_l(tmp_path):
    model, processor = tiny_model("llava")
    inputs = tiny_inputs(processor, "llava", two_samples("llava")[:1])
    length = inputs["input_ids"].shape[1]
    ratios = [0.25, 0.5, 0.35, 0.6]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "vtprune-prefixkv-profile", "model_type": "llava", "num_layers": 4,
                                "scope": "prompt", "budgets": {"0.5": ratios}}))
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt", profile=str(path), parity="release"):
        lengths = _prompt_and_cache(model, inputs)
    assert lengths == [length - min(round(r * length), length - 2) for r in ratios]  # Python's round: half to even
    with vtprune.apply(model, "prefixkv", keep=0.5, scope="prompt", profile=str(path)):
        default = _prompt_and_cache(model, inputs)
    assert default == [2 + n for n in counts_from_ratios(ratios, length - 2)]


def test_release_parity_needs_the_prompt_scope_for_prefixkv():
    model, _ = tiny_model("llava")
    with pytest.raises(ValueError, match="pass scope='prompt'"):
        vtprune.wrap(model, "prefixkv", keep=0.5, parity="release")
    with pytest.raises(ValueError, match="drop query_rows=8"):
        vtprune.wrap(model, "prefixkv", keep=0.5, scope="prompt", query_rows=8, parity="release")
