"""``--rounding``: the command line's ``rounding=`` (docs/serving.md), refused before any model loads where it has no
meaning."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("method", "match"), [("temporal", "spends one budget over a whole video"),
                                               ("prefixkv", "evicts cache entries")])
def test_per_image_rounding_refused_before_loading(cli, no_model, method, match):
    code, _, err = cli("run", "--method", method, "--rounding", "per_image")
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1


def test_rounding_reaches_the_wrap_options():
    import argparse

    from vtprune.cli.options import add_pruning_arguments, pruning_choice

    parser = argparse.ArgumentParser()
    add_pruning_arguments(parser)
    choice = pruning_choice(parser.parse_args(["--method", "divprune", "--rounding", "per_image"]))
    assert choice.options == {"rounding": "per_image"}
