"""Bad input, continued (tests/cli/test_bad_input.py): numbers of any kind are numbers, bools and strings are not;
one-line errors of bench reproduce; a method or keep listed twice."""

from __future__ import annotations

import pytest
import torch

import vtprune
from vtprune.models.tiny import random_image, tiny_inputs, tiny_model


def _one_line(err: str) -> bool:
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err and "usage:" not in err


# -- numbers are numbers; bools and strings are not ---------------------------------------------------------------
@pytest.mark.parametrize("keep", [True, "np.True_", "torch.tensor(True)", "'0.25'", "torch.tensor([0.25])"])
def test_a_keep_that_is_not_a_number_is_refused_by_wrap(keep):
    import numpy as np  # noqa: F401  (the parameters name NumPy and torch values)

    value = eval(keep) if isinstance(keep, str) else keep
    model, _ = tiny_model("llava")
    with pytest.raises(ValueError, match=r"keep must be a number in \(0, 1\]") as error:
        vtprune.wrap(model, "fastv", keep=value)
    assert len(str(error.value).splitlines()) == 1


def test_numbers_of_any_kind_are_accepted_as_their_value():
    """NumPy scalars and 0-d tensors act as the Python number they hold (the kept tokens are the same)."""
    import numpy as np

    model, processor = tiny_model("llava")
    inputs = tiny_inputs(processor, "llava", [("what color is the circle?", [random_image(64, 64, 1)])])
    runs = {"random": ({"seed": 3}, {"seed": np.int64(3)}, {"seed": torch.tensor(3)}),
            "transprune": ({"alpha": 0.5}, {"alpha": np.float32(0.5)}, {"alpha": torch.tensor(0.5)})}
    for method, variants in runs.items():
        kept = []
        for keep, options in zip((0.5, np.float32(0.5), torch.tensor(0.5)), variants, strict=True):
            with vtprune.apply(model, method, keep=keep, **options) as handle, torch.no_grad():
                model(**inputs)
                kept.append(handle.last_stats.kept_indices)
        assert kept[0] == kept[1] == kept[2], method
    for options in ({"seed": np.True_}, {"seed": np.float64(2.5)}):
        with pytest.raises(ValueError, match="seed="):
            vtprune.wrap(model, "random", keep=0.5, **options)
    with pytest.raises(ValueError, match="alpha="):
        vtprune.wrap(model, "transprune", keep=0.5, alpha=np.True_)


@pytest.mark.parametrize("words", [["--batch-size", "0"], ["--checkpoint", "bogus"], ["--bogus-option"]])
def test_bench_reproduce_errors_are_one_line_without_a_usage_block(cli, no_model, tmp_path, words):
    code, out, err = cli("bench", "reproduce", "--dry-run", "--out", str(tmp_path / "r"), *words)
    assert code == 2 and out == "" and _one_line(err) and err.startswith("vtprune bench reproduce: error:"), err


@pytest.mark.parametrize("words,needle", [
    (["--methods", "none,fastv,fastv"], "'fastv' is listed twice"), (["--keep", "0.5,0.5"], "'0.5' is listed twice"),
    (["--keep", "1,1.0"], "'1' and '1.0' are listed twice"),
])
def test_bench_refuses_a_method_or_keep_listed_twice(cli, no_model, tmp_path, words, needle):
    """Each would run, and be reported, twice."""
    code, _, err = cli("bench", "--out", str(tmp_path / "r"), *words)
    assert code == 2 and needle in err and _one_line(err), err
