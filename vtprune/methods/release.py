"""Token-for-token parity with the authors' released code: ``vtprune.wrap(..., parity="release")``.

vtprune's defaults differ from the releases in a few documented details; ``parity="release"`` takes each
method's released behaviour instead (its :class:`ReleaseRule`), so a paper's table can be reproduced token for
token when the prompt, the image processing and the scoring layer are those of the release:

============  ===============================  ================================  =====================================
method        kept count per stage             position ids                      ``+debias`` (arXiv:2508.17807 patches)
============  ===============================  ================================  =====================================
fastv         ``R`` (``fast_v_attention_rank``, compacting nothing: kept tokens  ``w = 1 / (1 + 1.7368u - 4.8432u^2 +
              an absolute count; ``keep =     keep their original ids            4.9097u^3)``, ``tau = 0.5``, the count
              R / N0`` gives exactly ``R``)   (``position_ids = keep_indexs``)   lowered to the unpadded tokens
pdrop         ``int(N0 * ratio_s)``           compacted to ``0..L'-1`` after     ``exp(-sigma x)`` (per-benchmark files;
              (truncation)                    each drop, decode ids shifted      default sigma 1.9), **stage 0 only**,
                                                                                 ``tau = 0.01``
transprune,   ``int(N0 * ratio_s)``           compacted, as PyramidDrop's        no release (refused)
ttv
visionzip     vtprune's count; contextual      original                          not debiasable
              value ``target + mean(others)``
prefixkv      the release's per-layer          original (cached keys)            not applicable
              evictions (``counting=
              "release"``, ``scope="prompt"``)
============  ===============================  ================================  =====================================

The leaders' methods (``sparsevlm``, ``vscan``, ``vispruner``, ``hiprune``, ``cdpruner``, ``mmtok``, ``scope``,
``idpruner``) declare their rules in their own modules; docs/methods.md's parity table lists every rule.

vtprune's defaults: ``keep_count`` rounds half up (``floor(keep N0 + 0.5)``), positions stay original (the only
policy consistent with ``generate`` and Qwen's M-RoPE), debiasing runs at every stage with ``sigma = 1.9`` and
``tau = 0.5`` (or a ``vtprune calibrate`` fit: the recommended path); a rule's ``options`` set method options
to the release's behaviour (VisionZip's ``context_value``, PrefixKV's ``counting``). Methods without a rule (``vflowopt``,
``random``, ``oracle``, wrappers other than ``+debias``, user scorers without a ``release`` attribute) refuse
``parity="release"`` at wrap time.

Counts are ``int(N0 * stage.keep)`` on the stage's float, as the release computes them on its ratio list: to
reproduce a released configuration exactly, pass its ratios as the schedule (``schedule="8:0.5,16:0.25,24:0.125"``
for PyramidDrop's LLaVA-1.5 default); a default schedule's computed fractions (``keep^(i/3)``) may differ from a
written ratio in the last bit, which truncation can turn into one token when ``N0 * ratio`` is an integer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vtprune.methods.base import Scorer
from vtprune.methods.debias import Debiased, ReleaseDebias, release_debiased


@dataclass(frozen=True)
class ReleaseRule:
    """How a method's released code counts, positions and debiases (see the module table).

    ``count``: ``"truncate"`` (``int(N0 * keep)``, at least 1) or ``"round"`` (vtprune's ``keep_count``, for
    releases that take an absolute count). ``positions``: ``"original"`` or ``"compact"``. ``debias``: the
    released debiasing patch for this host, or None when the debiasing release has none. ``source``: the
    released code (named in errors and docs). ``options``: method options set to the release's behaviour
    (``(name, value)`` pairs, e.g. VisionZip's ``context_value="release"``).
    """

    count: str
    positions: str
    source: str
    debias: ReleaseDebias | None = None
    options: tuple[tuple[str, Any], ...] = ()


def release_rule(scorer: Scorer) -> ReleaseRule | None:
    """The rule of ``scorer``'s method (through ``+debias``), or None when it has none."""
    inner = scorer.inner if isinstance(scorer, Debiased) else scorer
    if isinstance(inner, Debiased) or not isinstance(getattr(type(inner), "release", None), ReleaseRule):
        return None
    return type(inner).release


def methods_with_rules() -> list[str]:
    """Registered methods that accept ``parity="release"``."""
    from vtprune.methods.registry import METHODS

    return sorted(name for name, factory in METHODS.items() if isinstance(getattr(factory, "release", None), ReleaseRule))


def for_release(scorer: Scorer, adapter: Any, requested_positions: str) -> tuple[Scorer, ReleaseRule]:
    """The scorer and rule for ``parity="release"``; ValueError naming the fix when the method or model has none."""
    rule = release_rule(scorer)
    if rule is None:
        raise ValueError(
            f"parity='release' is not available for method {scorer.name!r}: vtprune has no release rule for it "
            f"(methods with one: {', '.join(methods_with_rules())}); use parity='default'."
        )
    if requested_positions == "compact" and rule.positions != "compact":
        raise ValueError(f"parity='release' for {scorer.name!r} keeps original position ids as its release "
                         f"({rule.source}) does; drop positions='compact' or use parity='default'.")
    if rule.positions == "compact" and "compact_positions" not in adapter.capabilities:
        raise ValueError(
            f"parity='release' for {scorer.name!r} compacts position ids after each drop as its release "
            f"({rule.source}) does on LLaVA's 1-D RoPE; {adapter.config.model_type} uses 3-D M-RoPE positions, "
            "for which no release exists and vtprune does not renumber: use parity='default' (original positions)."
        )
    if rule.options:
        scorer = with_release_options(scorer, rule)
    if isinstance(scorer, Debiased):
        if rule.debias is None:
            raise ValueError(
                f"parity='release' with debias: the debiasing release (intcomp/attention-bias) patches FastV and "
                f"PyramidDrop, not {scorer.inner.name!r}; drop debias / '+debias' or use parity='default'."
            )
        scorer = release_debiased(scorer, rule.debias)
    return scorer, rule



def with_release_options(scorer: Scorer, rule: ReleaseRule) -> Scorer:
    """``scorer`` (a frozen dataclass) with the rule's options set: the method's released behaviour."""
    try:
        if isinstance(scorer, Debiased):
            return dataclasses.replace(scorer, inner=dataclasses.replace(scorer.inner, **dict(rule.options)))
        return dataclasses.replace(scorer, **dict(rule.options))
    except ValueError as error:
        raise ValueError(f"parity='release' for {scorer.name!r} ({rule.source}): {error}") from error
