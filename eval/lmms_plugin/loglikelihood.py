"""What the plugin's ``loglikelihood`` returns, in the form the installed lmms-eval scores correctly.

Two facts about lmms-eval (0.7.3, the pinned version), checked by ``tests/eval/test_lmms_eval.py``:

* its ``multiple_choice`` scoring picks the **argmin** of the returned values, because its own models return a
  loss (``EvolvingLMMs-Lab/lmms-eval#370``), while its API docstring says "log probability". A log probability
  there picks the least likely answer. So the plugin returns the mean negative log-likelihood per continuation
  token by default (``loglikelihood=loss``, the value lmms-eval's ``llava_hf`` returns), and the summed log
  probability on request (``loglikelihood=logprob``).
* its evaluator passes every response through ``unwrap_generation_output``, which turns a plain
  ``(float, bool)`` tuple into its ``str()``; ``multiple_choice`` then fails ("too many values to unpack"). A
  :class:`LoglikelihoodResult` is a ``GenerationResult`` whose ``text`` is the pair, so the pair reaches the
  scoring intact; it also unpacks like the pair (``score, greedy = result``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lmms_eval.api.instance import GenerationResult

KINDS = ("loss", "logprob")


def score(logprob: float, n_tokens: int, kind: str) -> float:
    """``logprob`` (summed over ``n_tokens`` continuation tokens) as ``kind``: ``loss`` = ``-logprob / n_tokens``."""
    return logprob if kind == "logprob" else -logprob / n_tokens


@dataclass
class LoglikelihoodResult(GenerationResult):
    """``(score, is_greedy)`` for lmms-eval: ``text`` holds the pair; iterates, indexes and compares like it."""

    def __iter__(self) -> Iterator[Any]:
        return iter(self.text)

    def __getitem__(self, index: int) -> Any:
        return self.text[index]

    def __len__(self) -> int:
        return len(self.text)


def result(value: float, greedy: bool) -> LoglikelihoodResult:
    """The pair as lmms-eval's evaluator will keep it."""
    return LoglikelihoodResult(text=(float(value), bool(greedy)))  # type: ignore[arg-type]  # a pair, see above
