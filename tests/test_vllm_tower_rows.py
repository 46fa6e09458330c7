"""The vLLM plugin's selection for the tower-attention leaders (vispruner, hiprune, scope), in the main venv (no
vLLM here): each per-image rule on a hand-computed case and against the method's own pure function.

The engine tests (kept rows, tokens and log-probabilities against the transformers path) live in
tests/vllm/test_tower_leaders.py.
"""

from __future__ import annotations

import torch

from vtprune.vllm import settings
from vtprune.vllm.select import kept_count


def test_vispruner_rows_keep_the_important_then_the_diverse_rows():
    """Hand case (8 rows, keep 0.5 -> 4): attention falls with the index, so rows 0, 1 are the important half; of
    the rest, the first round drops a = [2, 4, 6] (at most min(8, 6 - 2) = 4), the second drops row 3 of a = [3, 7],
    a duplicate of b = [5] (row 7 is orthogonal to it): rows 0, 1, 5, 7, not the top-attention 0, 1, 2, 3."""
    from vtprune.methods.vispruner import RELEASED_RATIO, important_diverse
    from vtprune.vllm.select import vispruner_rows

    attention = torch.arange(8, 0, -1, dtype=torch.float32) / 10
    features = torch.eye(8)
    features[3] = features[5]
    assert vispruner_rows(attention, features, 0.5).tolist() == [0, 1, 5, 7]
    generator = torch.Generator().manual_seed(0)
    for n, keep in ((50, 0.25), (37, 0.5), (16, 0.1)):
        attention, features = torch.rand(n, generator=generator), torch.randn(n, 12, generator=generator)
        rows = vispruner_rows(attention, features, keep)
        assert rows.numel() == kept_count(keep, n, method="vispruner")
        assert rows.tolist() == sorted(important_diverse(attention, features, rows.numel(), RELEASED_RATIO).tolist())


def test_hiprune_rows_keep_the_anchor_cross_then_the_deep_registers():
    """Hand case (8 x 8 grid, keep 0.5 -> 32 rows, round(32 * 0.1 / 5) = 1 anchor): the object layer's peak at row
    27 (grid row 3, column 3) brings its cross 19, 26, 28, 35; the deep layer, rising with the index, fills the
    other 27 rows from the end (63 .. 37, row 35 already kept)."""
    from vtprune.methods.hiprune import RELEASED_ALPHA, hierarchical_select
    from vtprune.vllm.select import hiprune_rows

    shallow = torch.zeros(64)
    shallow[27] = 1.0
    deep = torch.arange(64, dtype=torch.float32)
    assert hiprune_rows(shallow, deep, 0.5, 8).tolist() == [19, 26, 27, 28, 35, *range(37, 64)]
    generator = torch.Generator().manual_seed(1)
    for side, keep in ((12, 0.25), (6, 0.5), (16, 0.1)):
        shallow, deep = torch.rand(side * side, generator=generator), torch.rand(side * side, generator=generator)
        rows = hiprune_rows(shallow, deep, keep, side)
        assert rows.numel() == kept_count(keep, side * side, method="hiprune")
        assert rows.tolist() == sorted(hierarchical_select(shallow, deep, rows.numel(), side, RELEASED_ALPHA).tolist())


def test_scope_rows_keep_the_most_salient_coverage_not_the_top_saliency():
    """Hand case (5 rows, keep 0.6 -> 3): rows 0 and 1 are duplicates, 2, 3, 4 orthogonal. Step 1 gains
    (coverage x saliency): 2 x 0.30, 2 x 0.28, 0.20, 0.10, 0.15 -> row 0; then row 1 adds no coverage (0), so
    row 2 (0.20), then row 4 (0.15): rows 0, 2, 4, where the top saliency keeps 0, 1, 2."""
    from vtprune.methods.scope import RELEASED_ALPHA, saliency_coverage_order
    from vtprune.vllm.select import scope_rows

    saliency = torch.tensor([0.30, 0.28, 0.20, 0.10, 0.15])
    features = torch.eye(5)
    features[1] = features[0]
    assert scope_rows(saliency, features, 0.6).tolist() == [0, 2, 4]
    generator = torch.Generator().manual_seed(2)
    for n, keep in ((50, 0.25), (37, 0.5), (16, 0.1)):
        saliency, features = torch.rand(n, generator=generator), torch.randn(n, 12, generator=generator)
        rows = scope_rows(saliency, features, keep)
        assert rows.numel() == kept_count(keep, n, method="scope")
        order = saliency_coverage_order(saliency, features, n, RELEASED_ALPHA)  # the whole greedy: its prefix
        assert rows.tolist() == sorted(order[:rows.numel()].tolist())


def test_tower_leaders_served_on_llava_and_qwen():
    for method in ("vispruner", "hiprune", "scope"):
        assert settings.check_method(method) == method and method in settings.TOWER_METHODS
        assert not settings.VllmPruning.from_dict({"method": method, "keep": 0.25}).layer_wise
