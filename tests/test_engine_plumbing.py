"""How the engine's parts are plumbed: the configuration is frozen, the plan is the one source of budgets, the
prefill / decode / KV helpers take the plan, the adapter and the call (never the handle), the call state is data
only and the stage step is short. Each check reads the source (or the objects), not the engine's results."""

from __future__ import annotations

import dataclasses

import pytest

from vtprune.config import PruneConfig


def test_prune_config_is_frozen_and_replace_derives_a_checked_copy():
    config = PruneConfig(method="fastv+debias", keep=0.5, layer=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.keep = 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "pdrop"
    changed = dataclasses.replace(config, keep=0.25)
    assert (changed.method, changed.debias, changed.keep, changed.stages[0].keep) == ("fastv", True, 0.25, 0.25)
    assert (config.keep, config.stages[0].keep) == (0.5, 0.5)
    with pytest.raises(ValueError, match="keep must be in"):
        dataclasses.replace(config, keep=1.5)
