"""PrefixKV (Wang et al., arXiv:2412.03409): layer-adaptive KV-cache retention.

KV compression, not sequence pruning: every layer computes over every token at prefill, and afterwards each
layer's cache keeps its own subset of the evictable tokens (``scope="visual"``: the visual tokens, the rest of
the prompt kept; ``scope="prompt"``: the whole prompt but its first ``start`` tokens and the last token).

* **Priority** of a cached key at layer ``l``: the head-averaged attention it receives, summed over the prompt's
  query rows (:func:`vtprune.kv_priority.received_attention`, recomputed from the layer's q/k one block of rows at
  a time, never an ``L x L`` matrix; the vLLM plugin sums with the same function; ``query_rows=n``
  samples ``n`` evenly spaced rows instead).
* **Per-layer retention** (the paper's global prefix configuration): sort each layer's priorities, normalise
  them to sum 1 and take the cumulative curve ``P_l(n)``; one threshold ``p`` gives ``keep_l = #{n: P_l(n) < p}
  + 1`` tokens per layer; ``p`` is found by bisection so that the layers keep ``keep`` of the evictable tokens on
  average, then the counts are adjusted one token at a time (next-best priority first) to hit it exactly.
  Without a profile this runs per call and per sample; ``vtprune calibrate --method prefixkv`` stores the
  mean per-layer eviction ratios of a model for a grid of budgets (``profile=FILE``), as the released
  ``confs/*.json``. ``counting="release"`` (what ``parity="release"`` sets; ``scope="prompt"``) takes the
  release's counts instead: :func:`release_evictions` / :func:`release_kept` (docs/methods.md, PrefixKV).
* **Decode**: ``decode="keep"`` (default) keeps every generated token and the compressed prompt;
  ``decode="release"`` (``scope="prompt"``, with a profile) keeps each layer's cache at ``(1 - ratio_l)`` of the
  tokens seen by evicting, when one must go, the entry ``distance`` (-25) before the end of the compressed
  prompt (the release's Elastic-Cache rule); such evictions are masked, not moved, so they do not shrink
  memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from vtprune.config import Stage
from vtprune.errors import UserError
from vtprune.kv_priority import received_attention
from vtprune.methods.base import KVRetention, Scorer
from vtprune.methods.registry import register_method
from vtprune.methods.release import ReleaseRule
from vtprune.scoring import ScoreContext

PROFILE_FORMAT = "vtprune-prefixkv-profile"
SCOPES = ("visual", "prompt")
DECODE_POLICIES = ("keep", "release")
COUNTING = ("exact", "release")
RELEASE_TOLERANCE = 5  # the release's search stops within 5 evicted tokens of its target
RELEASE_HALVINGS = 200  # the release halves until left == right; a cap where floats stop moving


@register_method
@dataclass(frozen=True)
class PrefixKV(Scorer):
    """Layer-adaptive KV-cache retention: each layer's cache keeps its top-priority tokens (PrefixKV)."""

    name: ClassVar[str] = "prefixkv"
    requires: ClassVar[frozenset[str]] = frozenset({"attention", "llm_layers"})
    release: ClassVar[ReleaseRule] = ReleaseRule(count="round", positions="original", source="THU-MIG/PrefixKV",
                                                 options=(("counting", "release"),))
    scope: str = "visual"
    query_rows: int | None = None
    start: int = 1
    decode: str = "keep"
    distance: int = -25
    profile: str | None = None
    counting: str = "exact"

    def __post_init__(self) -> None:
        if self.counting not in COUNTING:
            raise ValueError(f"counting={self.counting!r} must be one of {', '.join(COUNTING)} (how per-layer counts "
                             "are found).")
        if self.counting == "release" and self.query_rows is not None:
            raise ValueError(f"counting='release' (parity='release') scores every prompt row as the release does; drop "
                             f"query_rows={self.query_rows!r}.")
        if self.counting == "release" and self.scope != "prompt":
            raise ValueError("counting='release' (parity='release') counts over the whole prompt as the release "
                             "does, which evicts from the prompt but its first `start` and last tokens: pass "
                             "scope='prompt' (command line: a --config file with \"wrap_options\": {\"scope\": "
                             "\"prompt\"}).")
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r} must be one of {', '.join(SCOPES)} (which tokens may be evicted).")
        if self.decode not in DECODE_POLICIES:
            raise ValueError(f"decode={self.decode!r} must be one of {', '.join(DECODE_POLICIES)}.")
        if self.query_rows is not None and (_not_int(self.query_rows) or self.query_rows < 1):
            raise ValueError(f"query_rows={self.query_rows!r} must be a positive int or None (every prompt row).")
        if _not_int(self.start) or self.start < 0:
            raise ValueError(f"start={self.start!r} must be an int >= 0 (protected first prompt tokens).")
        if _not_int(self.distance):
            raise ValueError(f"distance={self.distance!r} must be an int (decode evictions land this many entries "
                             "from the end of the compressed prompt; the release uses -25).")
        if self.decode == "release" and (self.scope != "prompt" or self.profile is None):
            raise ValueError("decode='release' evicts generated context at a fixed per-layer ratio: it needs "
                             "scope='prompt' and profile=FILE (from `vtprune calibrate --method prefixkv`).")

    def kv_retention(self) -> KVRetention:
        """Which entries may leave each layer's cache, and how their per-layer counts are found."""
        return KVRetention(scope=self.scope, start=self.start, profile=self.profile, counting=self.counting,
                           decode=self.decode, distance=self.distance)

    def schedule(self, num_layers: int, keep: float) -> tuple[Stage, ...]:
        return ()  # no sequence pruning: the hidden states keep every token

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """Priority ``[B, L]`` of every cached key of this layer (attention received over the query rows; every row
        when ``query_rows`` reaches the prompt's length)."""
        rows = self.query_rows
        return priority(ctx, None if rows is not None and rows >= ctx.valid.shape[1] else rows)


def priority(ctx: ScoreContext, rows: int | None = None) -> torch.Tensor:
    """``[B, L]`` fp32: the head-averaged attention each slot receives from the layer's query rows, summed
    (:func:`vtprune.kv_priority.received_attention`). ``rows=None``: every valid position queries; ``rows=n``: ``n``
    evenly spaced valid positions of each sample, its last one included."""
    if ctx.layer is None or ctx.position_embeddings is None:
        raise RuntimeError("PrefixKV's priority needs a decoder layer; the pre-LLM stage has none.")
    batch, length = ctx.valid.shape
    positions = torch.arange(length, device=ctx.valid.device).expand(batch, length)
    if rows is None:
        index, mask = positions, ctx.valid
    else:
        first = torch.where(ctx.valid, positions, length).min(dim=1).values
        count = ctx.valid.sum(dim=1)
        steps = torch.linspace(0, 1, max(int(rows), 1), device=ctx.valid.device)
        index = first[:, None] + (steps[None, :] * (count[:, None] - 1).clamp(min=0)).round().long()
        mask = torch.ones_like(index, dtype=torch.bool)
    query, key = ctx.adapter.project_qk(ctx.layer, ctx.hidden, ctx.position_embeddings, index)
    scaling = float(getattr(ctx.layer.self_attn, "scaling", query.shape[-1] ** -0.5))
    return received_attention(query, key, index, mask, ctx.valid, scaling,
                              rows_at_positions=rows is None).to(ctx.valid.device)


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


# -- pure functions ----------------------------------------------------------------------------------------
def retention_curves(priority: torch.Tensor) -> torch.Tensor:
    """``P_l(n)`` ``[layers, N]``: cumulative share of layer ``l``'s priority held by its top ``n + 1`` tokens."""
    return torch.from_numpy(_curves(priority.detach().cpu().double().numpy()))


def _curves(values: np.ndarray) -> np.ndarray:
    """:func:`retention_curves` on a host array (fp64); a layer whose priorities are all 0 is uniform."""
    ordered = -np.sort(-np.clip(values, 0.0, None), axis=1)
    total = ordered.sum(axis=1, keepdims=True)
    share = np.where(total > 0, ordered / np.maximum(total, 1e-300), 1.0 / max(values.shape[1], 1))
    return share.cumsum(axis=1)


def counts_at(curves: torch.Tensor, threshold: float) -> torch.Tensor:
    """``keep_l = #{n : P_l(n) < threshold} + 1`` per layer (at most ``N``)."""
    return ((curves < threshold).sum(dim=1) + 1).clamp(max=curves.shape[1])


def layer_budgets(priority: torch.Tensor | np.ndarray, keep: float, iterations: int = 60) -> list[int]:
    """Tokens each layer keeps (``[layers]``) so that together they keep ``keep`` of ``layers x N`` exactly.

    priority: ``[layers, N]`` one sample's priorities of its evictable tokens, on the host (a CPU tensor or an
    array: the search reads values in a loop). Bisection on the prefix threshold of :func:`retention_curves`,
    then one token at a time: added where the next token has the largest priority share, removed where the
    last kept one has the smallest (never below 1 per layer).
    """
    values = np.asarray(priority, dtype=np.float64)
    layers, n = values.shape
    if n == 0:
        return [0] * layers
    target = min(layers * n, max(layers, math.floor(keep * layers * n + 0.5)))
    curves = _curves(values)
    shares = np.diff(curves, axis=1, prepend=0.0)

    def counts(threshold: float) -> np.ndarray:
        return np.minimum((curves < threshold).sum(axis=1) + 1, n)

    low, high = 0.0, 1.0 + 1e-9
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if counts(middle).sum() < target else (low, middle)
    kept = counts(high).tolist()
    while sum(kept) != target:
        if sum(kept) < target:
            layer = max((i for i in range(layers) if kept[i] < n), key=lambda i: (shares[i, kept[i]], -i))
            kept[layer] += 1
        else:
            layer = min((i for i in range(layers) if kept[i] > 1), key=lambda i: (shares[i, kept[i] - 1], i))
            kept[layer] -= 1
    return kept


def counts_from_ratios(ratios: list[float], n: int) -> list[int]:
    """Tokens each layer keeps from ``n`` given per-layer eviction ratios (``round(ratio * n)`` evicted)."""
    return [max(min(n, 1), n - math.floor(r * n + 0.5)) for r in ratios]


# -- the release's counts (``counting="release"``, ``parity="release"``) -------------------------------------
def release_evictions(priority: np.ndarray, ratio: float, protect: int) -> np.ndarray:
    """Tokens each layer evicts ``[layers]`` under the release's search (THU-MIG/PrefixKV ``obtain_cdf_num`` and
    its caller), for one sample.

    priority: ``[layers, L]`` over the **whole** prompt (the protected tokens included); ratio: the eviction
    ratio ``1 - keep``; protect: tokens never evicted (``start`` + the last one). Per layer, ``P_l`` is the
    cumulative share of its priorities sorted in descending order (fp32, as the release computes it) and a
    threshold ``p`` evicts ``max(0, L - (#{n: P_l(n) < p} + 1) - protect)``; ``p`` is bisected from 0.5 in
    (0, 1) until the layers' total is within :data:`RELEASE_TOLERANCE` of the target ``ratio * L * layers``;
    the counts are then rescaled by ``target / total`` and truncated to ints.
    """
    layers, length = priority.shape
    target = float(ratio) * length * layers
    ordered = torch.from_numpy(np.asarray(priority, dtype=np.float32)).sort(dim=1, descending=True).values
    total = ordered.sum(dim=1, keepdim=True)
    curves = torch.where(total > 0, ordered / total.clamp(min=1e-30), 1.0 / max(length, 1)).cumsum(dim=1)

    def evicted(threshold: float) -> np.ndarray:
        below = (curves < threshold).sum(dim=1).numpy().astype(np.int64)  # searchsorted(..., right=False)
        return np.maximum(length - (below + 1) - protect, 0)

    left, right, middle = 0.0, 1.0, 0.0
    for _ in range(RELEASE_HALVINGS):
        if not left < right:
            break
        middle = (left + right) / 2.0
        count = int(evicted(middle).sum())
        if abs(count - target) < RELEASE_TOLERANCE:
            break
        left, right = (left, middle) if count < target else (middle, right)
    counts = evicted(middle)
    if counts.sum() != 0:
        counts = counts * target / counts.sum()
    return counts.astype(np.int32)


def release_kept(length: int, evictable: int, keep: float, priority: np.ndarray | None = None,
                 ratios: list[float] | None = None) -> list[int]:
    """Evictable tokens each layer keeps under the release's counts, for one sample of ``length`` prompt tokens.

    With a profile (``ratios``): ``round(r_l * length)`` evicted (numpy's half-to-even ``round``, as the
    release), else :func:`release_evictions` on ``priority`` ``[layers, length]`` at ``1 - keep``. At most the
    ``evictable`` tokens go (the release's slice of its sorted candidates ends there).
    """
    if ratios is not None:
        evicted = np.round(np.asarray(ratios, dtype=np.float64) * length).astype(np.int64)
    else:
        evicted = release_evictions(priority, 1.0 - keep, length - evictable)
    return [int(evictable - min(int(e), evictable)) for e in evicted]


# -- profiles (`vtprune calibrate --method prefixkv`) --------------------------------------------------------
def read_profile(path: str | Path, model_type: str, num_layers: int, scope: str) -> dict[float, list[float]]:
    """``{budget: per-layer eviction ratios}`` of a profile file, checked against the model it is used on."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"PrefixKV profile {name!r} cannot be read as JSON ({error}); create it with "
                        "`vtprune calibrate --method prefixkv --out FILE`.") from error
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise UserError(f"{name!r} is not a PrefixKV profile (field 'format' must be {PROFILE_FORMAT!r}).")
    for field, want in (("model_type", model_type), ("num_layers", num_layers), ("scope", scope)):
        if data.get(field) != want:
            raise UserError(f"PrefixKV profile {name!r} was made for {field}={data.get(field)!r}, but this run has "
                            f"{field}={want!r}; calibrate a profile for this model and scope.")
    budgets = data.get("budgets")
    if not isinstance(budgets, dict) or not budgets:
        raise UserError(f"PrefixKV profile {name!r}: field 'budgets' must map keep fractions to per-layer ratios.")
    result = {}
    for key, ratios in budgets.items():
        result[_budget_key(key, name)] = _ratios(ratios, key, name, num_layers)
    return result


def _budget_key(key: str, name: str) -> float:
    """A profile's budget key as a keep fraction in (0, 1]; UserError naming the file and the key."""
    try:
        value = float(key)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:  # NaN fails too
        raise UserError(f"PrefixKV profile {name!r}: budgets key {key!r} must be a keep fraction in (0, 1] such as "
                        "'0.5'; recreate the profile with `vtprune calibrate --method prefixkv`.")
    return value


def _ratios(ratios: object, key: str, name: str, num_layers: int) -> list[float]:
    """``num_layers`` eviction ratios in [0, 1] (numbers, not ``true`` / ``false``)."""
    ok = isinstance(ratios, list) and len(ratios) == num_layers and all(
        isinstance(r, int | float) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in ratios)
    if not ok:
        raise UserError(f"PrefixKV profile {name!r}: budgets[{key!r}] must be {num_layers} ratios in [0, 1] (numbers, "
                        f"not true/false: the per-layer eviction ratios), got {str(ratios)[:80]}.")
    return [float(r) for r in ratios]


def profile_ratios(budgets: dict[float, list[float]], keep: float, name: str = "profile") -> list[float]:
    """Per-layer eviction ratios for ``keep``, interpolated linearly between the profile's budgets."""
    grid = sorted(budgets)
    if not grid[0] - 1e-9 <= keep <= grid[-1] + 1e-9:
        raise UserError(f"keep={keep} is outside the budgets of PrefixKV {name} ({grid[0]:g} to {grid[-1]:g}); "
                        "calibrate it for this budget or pick a keep inside that range.")
    for low, high in zip(grid, grid[1:], strict=False):
        if low <= keep <= high:
            weight = 0.0 if high == low else (keep - low) / (high - low)
            return [a + weight * (b - a) for a, b in zip(budgets[low], budgets[high], strict=True)]
    return list(budgets[grid[0]])
