"""MMTok's selection equals the authors' release on fixed inputs, and its pure parts on hand-computed cases.

``tests/data/release_mmtok.json`` holds seeded inputs and the indices the release's own
``SemanticTokenSelector.mm_coverage_selection`` (Ironieser/MMTok, commit in the file; its Python loop and its
TorchScript kernel) selected on them, run once outside this repository.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vtprune.methods.mmtok import coverage_matrix, greedy_coverage_order, select

DATA = json.loads((Path(__file__).parents[1] / "data" / "release_mmtok.json").read_text())


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: f"n{len(c['image'])}-m{len(c['text'])}-{c['path']}")
def test_kept_indices_equal_the_release(case):
    image = torch.tensor(case["image"])
    text = torch.tensor(case["text"]).reshape(-1, image.shape[1])
    kept = select(text, image, torch.tensor(case["tower"]), case["count"], case["alpha"], case["tv_temperature"],
                  case["vv_temperature"])
    assert kept.tolist() == case["kept"]


def test_the_file_names_the_release_and_both_of_its_paths():
    assert DATA["release"] == "Ironieser/MMTok" and len(DATA["commit"]) == 40
    assert {case["path"] for case in DATA["cases"]} == {"python", "jit"}


def test_coverage_rows_are_softmaxes_scaled_by_their_count():
    text = torch.tensor([[1.0, 0.0]])
    image = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    matrix = coverage_matrix(text, image, image, alpha=0.5, tv_temperature=1.0, vv_temperature=1.0)
    e = torch.e
    # text row: softmax(cos = [1, 0]) / 1; vision rows: softmax([[1, 0], [0, 1]]) / 2 * 0.5
    expected = torch.tensor([[e / (e + 1), 1 / (e + 1)],
                             [e / (e + 1) / 4, 1 / (e + 1) / 4],
                             [1 / (e + 1) / 4, e / (e + 1) / 4]])
    torch.testing.assert_close(matrix, expected)
    assert coverage_matrix(text[:0], image, image).shape == (2, 2)  # no text: the vision rows alone


def test_greedy_coverage_takes_the_largest_gain_then_what_is_left_uncovered():
    coverage = torch.tensor([[0.9, 0.8, 0.0],
                             [0.0, 0.7, 0.6],
                             [0.0, 0.0, 0.5]])
    # gains: [0.9, 1.5, 1.1] -> 1; then [0.1, -, 0.5] -> 2; then column 0 covers 0.9 - 0.8 = 0.1
    assert greedy_coverage_order(coverage, 3).tolist() == [1, 2, 0]
    assert greedy_coverage_order(coverage, 9).tolist() == [1, 2, 0]  # never more picks than columns


def test_a_column_is_never_picked_twice_even_without_gain():
    coverage = torch.tensor([[1.0, 0.0, 0.0]])
    assert greedy_coverage_order(coverage, 3).tolist() == [0, 1, 2]  # then zero gains: in token order
