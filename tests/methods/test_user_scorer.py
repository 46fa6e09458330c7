"""The README's user-defined scorer example runs as written, and user scorers compose like built-in ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import vtprune
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_scorer_example_runs(capsys):
    text = README.read_text()
    block = re.search(r"<!-- scorer-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "the README lost its scorer example"
    namespace: dict = {}
    exec(compile(block.group(1), "README.md:scorer-example", "exec"), namespace)  # noqa: S102 - our own README
    stats = namespace["handle"].last_stats
    assert stats.kept == [[8]] and stats.kept_indices == [[list(range(4, 12))]]
    assert "[[8]]" in capsys.readouterr().out


def test_user_scorer_with_schedule_captures_and_debias():
    from dataclasses import dataclass, field

    from vtprune.methods import Capture, Debiased, schedules

    @dataclass(frozen=True)
    class LastTokenNorm(vtprune.Scorer):
        """Attention of the last token, times the hidden-state norm captured after layer 0 (a toy)."""

        name = "last_token_norm"
        requires = frozenset({"attention"})
        seen: dict = field(default_factory=dict)

        def schedule(self, num_layers, keep):
            return schedules.pyramid(num_layers, keep)

        def captures(self, adapter, stages):
            def save(state, module, args, kwargs, output):
                state["norm"] = output.norm(dim=-1)
                self.seen["captured"] = self.seen.get("captured", 0) + 1

            return (Capture(adapter.decoder_layers[0], save),)

        def score(self, ctx):
            return ctx.attention("last")

    model, processor = tiny_model("llava", image_size=112)
    inputs = tiny_inputs(processor, "llava", [("what color?", [random_image(120, 90, 1)])])
    scorer = LastTokenNorm()
    with torch.no_grad(), vtprune.apply(model, scorer, keep=0.25, debias=True) as handle:
        model.generate(**inputs, max_new_tokens=3)
    assert isinstance(handle.scorer, Debiased) and handle.scorer.name == "last_token_norm+debias"
    assert [s.layer for s in handle.stages] == [1, 2, 3]
    assert scorer.seen["captured"] == 1  # the prefill only, never a decode step
    with pytest.raises(ValueError, match="are for named methods"):
        vtprune.wrap(model, scorer, keep=0.25, alpha=0.5)
