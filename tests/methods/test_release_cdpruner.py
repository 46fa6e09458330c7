"""CDPruner's selection equals the authors' release on fixed inputs, and its pure parts on hand-computed cases.

``tests/data/release_cdpruner.json`` holds seeded inputs and the indices the release's own ``encode_images``
(Theia-4869/CDPruner, commit in the file) selected on them, run once outside this repository with its vision
tower and projector stubbed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vtprune.methods.cdpruner import conditional_kernel, dpp_greedy_order, relevance, select

DATA = json.loads((Path(__file__).parents[1] / "data" / "release_cdpruner.json").read_text())


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: f"n{len(c['features'])}-k{c['count']}-t{c['theta']}")
def test_kept_indices_equal_the_release(case):
    kept = select(torch.tensor(case["features"]), torch.tensor(case["image"]), torch.tensor(case["text"]),
                  case["count"], negate=True, relevance_weight=case["theta"])
    assert kept.tolist() == case["kept"]


def test_the_file_names_the_release_and_its_commit():
    assert DATA["release"] == "Theia-4869/CDPruner" and len(DATA["commit"]) == 40


def test_relevance_is_min_max_normalised_cosine_and_negated_for_clip():
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    text = torch.tensor([[2.0, 0.0]])
    # cos = 1, 0, 1/sqrt(2): (r - 0 + 1e-6) / 1
    torch.testing.assert_close(relevance(image, text), torch.tensor([1.0, 0.0, 0.5 ** 0.5]) + 1e-6)
    # -cos = -1, 0, -0.7071: min -1, span 1
    torch.testing.assert_close(relevance(image, text, negate=True), torch.tensor([0.0, 1.0, 1 - 0.5 ** 0.5]) + 1e-6)
    assert relevance(image[:1], text).tolist() == [1.0]  # one token: nothing to normalise


def test_kernel_weights_similarity_by_relevance_and_theta():
    features = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    quality = torch.tensor([1.0, 0.5])
    torch.testing.assert_close(conditional_kernel(features, quality), torch.diag(torch.tensor([1.0, 0.25])))
    # theta = 0.5: alpha = 0.5, q = exp(0.5 r)
    expected = torch.diag(torch.exp(torch.tensor([1.0, 0.5])))
    torch.testing.assert_close(conditional_kernel(features, quality, 0.5), expected)


def test_greedy_map_picks_the_largest_gain_then_the_least_redundant():
    # token 0 has the largest quality; token 1 nearly duplicates it; token 2 is orthogonal with less quality
    features = torch.tensor([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0]])
    kernel = conditional_kernel(features, torch.tensor([1.0, 0.95, 0.6]))
    assert dpp_greedy_order(kernel, 3).tolist()[:2] == [0, 2]


def test_greedy_map_equals_exhaustive_log_det_gains():
    """Each greedy pick maximises log det of the kernel restricted to the picks so far (brute force)."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(9, 12, generator=generator, dtype=torch.float64)
    kernel = conditional_kernel(features, torch.rand(9, generator=generator) + 0.2).double()
    picks = dpp_greedy_order(kernel, 5).tolist()
    chosen: list[int] = []
    for pick in picks:
        dets = {j: torch.linalg.det(kernel[chosen + [j]][:, chosen + [j]]).item() for j in range(9) if j not in chosen}
        assert pick == max(dets, key=dets.get)
        chosen.append(pick)


def test_spent_gains_fall_back_to_relevance_order_without_nan():
    """Rank 2 kernel over 5 tokens: two DPP picks, then the rest by the fallback key (no division by zero)."""
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
    quality = torch.tensor([1.0, 0.9, 0.2, 0.5, 0.7])
    picks = dpp_greedy_order(conditional_kernel(features, quality), 5, quality).tolist()
    assert picks[:2] == [0, 1] and picks[2:] == [4, 3, 2]
