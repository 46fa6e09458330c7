"""Attention debiasing for token pruning (Attention Debiasing, arXiv:2508.17807).

A post-processor of any attention-based importance vector ``s`` over visual tokens (FastV, PyramidDrop,
TransPrune's IGA term)::

    s~_i = s_i * w_i * m_i,    w_i = 1 / f(x_i),    x_i = ordinal_i / N0,    m_i = [pad_i <= tau]

* ``x_i`` is the token's index in its sample's **whole** visual sequence (all images, all video frames,
  LLaVA-NeXT newline tokens included) divided by ``N0``, the sample's original visual-token count. The
  authors' choice for multi-image / video inputs is unknown (spec 2.2 step 9); the concatenated domain
  matches the "recency" explanation of the bias.
* ``f`` is the positional trend: ``mu * exp(sigma * x)`` (default ``sigma = 1.9``, the spec's default for
  last-token / text-rater attention on LLaVA-1.5-7B) or a piecewise-linear table fitted per model and
  scoring layer by ``vtprune calibrate`` (``calibration.json``). ``mu`` does not change the ranking.
* ``m_i = 0`` where the fraction of the token's patch that is image padding exceeds ``tau`` (default 0.5,
  FastV's value; PyramidDrop's release used 0.01). The fraction comes from
  :meth:`vtprune.adapters.Adapter.padding_fraction`. Masked tokens score 0 (not -inf) and the kept count
  is unchanged (FastV's patch lowers it instead).

Defaults and the releases: vtprune debiases every stage with ``sigma = 1.9`` and ``tau = 0.5`` unless a
``vtprune calibrate`` file (the recommended path) says otherwise. The released patches differ per host and are
an option, ``parity="release"`` (:mod:`vtprune.methods.release`, :data:`FASTV_RELEASE`, :data:`PDROP_RELEASE`):
FastV's weight is the reciprocal cubic ``1 / (1 + 1.7368u - 4.8432u^2 + 4.9097u^3)`` (``u = i / 576``, spec 2.2)
and its kept count drops to the unpadded tokens; PyramidDrop debiases its first stage only, ``tau = 0.01``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vtprune.calibration_check import load_calibration_json
from vtprune.methods.base import Scorer, Wrapper
from vtprune.scoring import ScoreContext

DEFAULT_SIGMA = 1.9
DEFAULT_TAU = 0.5
CALIBRATION_FILE = "calibration.json"
FORMAT = "vtprune-debias-calibration"


# -- pure functions ----------------------------------------------------------------------------------------
def exponential_trend(x: torch.Tensor, sigma: float, mu: float = 1.0) -> torch.Tensor:
    """``f(x) = mu * exp(sigma * x)`` elementwise."""
    return mu * torch.exp(sigma * x)


def table_trend(x: torch.Tensor, xs: list[float], ys: list[float]) -> torch.Tensor:
    """Piecewise-linear ``f`` through ``(xs, ys)`` (``xs`` increasing), constant beyond the ends."""
    grid = torch.as_tensor(xs, dtype=torch.float32, device=x.device)
    values = torch.as_tensor(ys, dtype=torch.float32, device=x.device)
    if grid.numel() == 1:
        return values.expand_as(x).clone()
    flat = x.float().clamp(float(grid[0]), float(grid[-1]))
    right = torch.searchsorted(grid, flat.contiguous(), right=True).clamp(1, grid.numel() - 1)
    x0, x1, y0, y1 = grid[right - 1], grid[right], values[right - 1], values[right]
    return y0 + (y1 - y0) * (flat - x0) / (x1 - x0).clamp_min(1e-12)


def relative_positions(ordinal: torch.Tensor, num_visual: torch.Tensor) -> torch.Tensor:
    """``x = ordinal / N0`` ``[B, L]`` (fp32) for visual slots, 0 elsewhere. ordinal: ``[B, L]``; num_visual: ``[B]``."""
    scale = num_visual.clamp_min(1).float().to(ordinal.device)[:, None]
    return torch.where(ordinal >= 0, ordinal.float() / scale, torch.zeros_like(ordinal, dtype=torch.float32))


def padding_keep_mask(ordinal: torch.Tensor, fractions: list[torch.Tensor] | None, tau: float) -> torch.Tensor:
    """``m`` ``[B, L]`` fp32: 0 on visual slots whose padding fraction exceeds ``tau``, 1 elsewhere.

    fractions: per sample ``[N0_b]`` padding fraction of each original visual token, or None (all 1).
    """
    mask = torch.ones(ordinal.shape, dtype=torch.float32, device=ordinal.device)
    if fractions is None:
        return mask
    for row, values in enumerate(fractions):
        if values is None or values.numel() == 0:
            continue
        values = values.to(ordinal.device).float()
        alive = ordinal[row] >= 0
        index = ordinal[row, alive].clamp(max=values.numel() - 1)
        mask[row, alive] = (values[index] <= tau).float()
    return mask


def debias(scores: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``s~ = s * w * m`` (all ``[B, L]``), in fp32."""
    return scores.float() * weights * mask


def fit_exponential(x: torch.Tensor, a: torch.Tensor) -> tuple[float, float, float]:
    """Least-squares fit of ``log a = log mu + sigma x``. x, a: ``[P]`` pooled pairs (``a > 0``).

    Returns ``(mu, sigma, r2)`` where ``r2`` is the coefficient of determination of the log-linear fit.
    """
    x = x.double()
    y = torch.log(a.double().clamp_min(1e-30))
    design = torch.stack([torch.ones_like(x), x], dim=1)
    solution = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    residual = y - design @ solution
    total = ((y - y.mean()) ** 2).sum()
    r2 = float(1.0 - (residual**2).sum() / total) if float(total) > 0 else 1.0
    return float(torch.exp(solution[0])), float(solution[1]), r2


def binned_curve(x: torch.Tensor, a: torch.Tensor, bins: int) -> tuple[list[float], list[float], list[int]]:
    """Mean of ``a`` in ``bins`` equal bins of ``x`` over ``[0, 1)``: (bin centres, means, counts); empty bins dropped."""
    index = (x.double() * bins).long().clamp(0, bins - 1)
    sums = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, a.double())
    counts = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(a, dtype=torch.float64))
    used = counts > 0
    centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    return (centres[used].tolist(), (sums[used] / counts[used]).tolist(), counts[used].long().tolist())


# -- the debiaser --------------------------------------------------------------------------------------------
def polynomial_trend(x: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    """``f(x) = sum_i c_i x^i`` elementwise (fp32); coefficients ``c_0, c_1, ...``."""
    total = torch.zeros_like(x, dtype=torch.float32)
    for coefficient in reversed(coefficients):  # Horner
        total = total * x.float() + coefficient
    return total


@dataclass
class Trend:
    """The positional trend of one scoring layer: exponential (``sigma``, ``mu``), a table (``xs``, ``ys``) or a
    polynomial (``poly``: ``c_0, c_1, ...``; FastV's released cubic)."""

    sigma: float = DEFAULT_SIGMA
    mu: float = 1.0
    xs: list[float] | None = None
    ys: list[float] | None = None
    poly: list[float] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.xs:
            return table_trend(x, self.xs, self.ys).clamp_min(1e-12)
        if self.poly:
            return polynomial_trend(x, self.poly).clamp_min(1e-12)
        return exponential_trend(x, self.sigma, self.mu)


@dataclass
class Debiaser:
    """Positional trends per scoring layer (``layers``; nearest layer used) plus the padding threshold."""

    layers: dict[int, Trend] = field(default_factory=dict)
    default: Trend = field(default_factory=Trend)
    tau: float = DEFAULT_TAU
    source: str = "default"

    def trend(self, layer_index: int) -> Trend:
        """The trend fitted at ``layer_index``, else at the nearest calibrated layer, else the default."""
        if not self.layers:
            return self.default
        nearest = min(self.layers, key=lambda k: (abs(k - layer_index), k))
        return self.layers[nearest]

    def weights(self, ordinal: torch.Tensor, num_visual: torch.Tensor, layer_index: int) -> torch.Tensor:
        """``w = 1 / f(x)`` ``[B, L]`` on visual slots (1 elsewhere)."""
        x = relative_positions(ordinal, num_visual)
        weights = 1.0 / self.trend(layer_index)(x)
        return torch.where(ordinal >= 0, weights, torch.ones_like(weights))


def read_calibration(path: str | Path, trend: str | None = None, model_type: str | None = None,
                     num_layers: int | None = None) -> Debiaser:
    """A :class:`Debiaser` from a ``vtprune calibrate`` file; ``trend`` (``"exp"``/``"curve"``) overrides its default;
    with ``model_type`` / ``num_layers``, a file fitted on another model type or a deeper model is refused."""
    data = load_calibration_json(path, FORMAT, model_type, num_layers)  # UserError naming the file and field
    kind = trend or data.get("trend", "exp")
    layers = {}
    for key, entry in data["layers"].items():
        curve = entry.get("curve") or {}
        if kind == "curve" and curve.get("x"):
            layers[int(key)] = Trend(xs=list(curve["x"]), ys=list(curve["mean"]))
        else:
            layers[int(key)] = Trend(sigma=float(entry["sigma"]), mu=float(entry.get("mu", 1.0)))
    return Debiaser(layers=layers, tau=float(data.get("tau", DEFAULT_TAU)), source=str(path))


def check_debias_option(value: Any) -> bool | str:
    """Validate ``debias=`` at wrap time: ``False``, ``True`` or an existing calibration file path."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_file():
            raise ValueError(
                f"debias={str(value)!r}: no such calibration file; pass debias=True for the model's default "
                "calibration or create a file with `vtprune calibrate --model PATH --out FILE`."
            )
        read_calibration(path)
        return str(path)
    raise ValueError(f"debias must be True, False or a calibration file path, got {value!r}.")


def model_calibration(model: Any) -> Path | None:
    """``calibration.json`` next to the model's config (``config._name_or_path``), if one ships."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    candidate = Path(name) / CALIBRATION_FILE if name else None
    return candidate if candidate is not None and candidate.is_file() else None


def debiaser_for(option: bool | str, model: Any) -> Debiaser:
    """``debias=True``: the model's shipped calibration or the default exponential trend; ``debias=PATH``: that file."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    layers = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", None)
    known = {"model_type": model_type, "num_layers": layers if isinstance(layers, int) else None}
    if isinstance(option, str):
        return read_calibration(option, **known)
    shipped = model_calibration(model)
    return read_calibration(shipped, **known) if shipped is not None else Debiaser()


def set_image_sizes(handle: Any, sizes: list[tuple[int, int]] | None) -> None:
    """Tell the padding mask the original ``(height, width)`` of every image of the next calls on this thread.

    Needed for LLaVA-1.5 when the images were padded to square (``LlavaImageProcessor(do_pad=True)`` or the
    original ``expand2square``): the model call has no argument that carries them. Pass None to clear.
    LLaVA-NeXT reads the processor's ``image_sizes`` from the call instead.
    """
    handle.set_image_sizes(sizes)


def debias_scores(debiaser: Debiaser, ctx: Any, scores: torch.Tensor) -> torch.Tensor:
    """Debias attention ``scores`` ``[B, L]`` for the scoring context ``ctx`` (padding map cached per call)."""
    if "debias_padding" not in ctx.state:
        inputs = ctx.inputs
        input_ids = inputs.get("input_ids")
        ctx.state["debias_padding"] = (
            ctx.adapter.padding_fraction(input_ids, inputs) if input_ids is not None else None
        )
    weights = debiaser.weights(ctx.ordinal, ctx.num_visual, ctx.layer_index)
    mask = padding_keep_mask(ctx.ordinal, ctx.state["debias_padding"], debiaser.tau)
    return debias(scores, weights, mask)


DEBIAS_HOSTS = "fastv, pdrop, sparsevlm, transprune"  # the registry's debiasable methods (tests check both agree)


def refuse_kv_retention(scorer: Scorer, hosts: str = DEBIAS_HOSTS) -> None:
    """ValueError when ``scorer`` retains KV entries (PrefixKV): its priority is the attention a key receives from
    every prompt row, summed, which the last-token recency trend of debiasing does not describe."""
    if scorer.kv_retention() is not None:
        raise ValueError(
            f"debias does not apply to method {scorer.name!r}: it keeps KV-cache entries by the attention they receive "
            "from every prompt row, not by the last token's attention whose position trend debiasing divides out; "
            f"drop debias / '+debias', or debias one of: {hosts}.")


@dataclass(frozen=True)
class Debiased(Wrapper):
    """Attention debiasing (arXiv:2508.17807) of every attention row the inner scorer reads.

    FastV and PyramidDrop score with attention only; TransPrune's TTV term is untouched and its IGA term is
    debiased, as in the paper. ``option`` is what the user passed (``True`` or a calibration file).
    ``stages``: indices of the plan's stages that are debiased (None: all; PyramidDrop's release: ``(0,)``).
    """

    debiaser: Debiaser = field(default_factory=Debiaser)
    option: bool | str = True
    stages: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        refuse_kv_retention(self.inner)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.inner.name}+debias"

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        if self.stages is not None and ctx.stage_index not in self.stages:
            return self.inner.score(ctx)
        return self.inner.score(dataclasses.replace(ctx, attention_filter=self.filter))

    def filter(self, ctx: ScoreContext, scores: torch.Tensor) -> torch.Tensor:
        return debias_scores(self.debiaser, ctx, scores)


# -- the released patches (``parity="release"``) ---------------------------------------------------------------
@dataclass(frozen=True)
class ReleaseDebias:
    """A host's released debiasing patch: the trend used for ``debias=True``, ``tau``, which stages, and
    whether the kept count drops to the tokens the padding mask lets through."""

    trend: Trend
    tau: float
    first_stage_only: bool = False
    lower_count: bool = False


#: FastV's patch: ``spline_weight`` = ``1 / (1 + 1.7368u - 4.8432u^2 + 4.9097u^3)`` (spec 2.2), ``tau = 0.5``,
#: ``k = min(R, unpadded tokens)``.
FASTV_RELEASE = ReleaseDebias(Trend(poly=[1.0, 1.7368, -4.8432, 4.9097]), tau=0.5, lower_count=True)
#: PyramidDrop's patch: per-benchmark ``exp(-sigma x)`` files (sigma 1.45-2.38, mean 1.89; default 1.9) applied
#: with the padding mask (``tau = 0.01``) at stage 0 only.
PDROP_RELEASE = ReleaseDebias(Trend(sigma=DEFAULT_SIGMA), tau=0.01, first_stage_only=True)


@dataclass(frozen=True)
class UnpaddedDebiased(Debiased):
    """:class:`Debiased` whose kept count drops to the tokens the padding mask lets through, as FastV's
    released patch does (``k = min(R, valid)``): a merge step that un-keeps masked visual tokens."""

    def merge(self, ctx: ScoreContext, kept: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """kept: ``[B, L]`` bool after selection; masked visual slots (padding fraction > tau) are dropped."""
        fractions = ctx.state.get("debias_padding")
        if fractions is None:
            return kept, hidden
        unmasked = padding_keep_mask(ctx.ordinal, fractions, self.debiaser.tau) > 0
        lowered = kept & unmasked
        some_left = (lowered & ctx.visual).any(dim=1, keepdim=True)  # an image of padding only keeps its picks
        return torch.where(some_left, lowered, kept), hidden


def release_debiased(scorer: Debiased, release: ReleaseDebias) -> Debiased:
    """``scorer`` with the host's released patch: its trend for ``debias=True`` (a calibration file keeps its
    fitted trend, as the release's per-benchmark weight files), the release's ``tau`` and stages."""
    fitted = read_calibration(scorer.option) if isinstance(scorer.option, str) else None
    debiaser = Debiaser(layers=fitted.layers if fitted else {}, default=release.trend, tau=release.tau,
                        source=fitted.source if fitted else "release")
    wrapper = UnpaddedDebiased if release.lower_count else Debiased
    return wrapper(inner=scorer.inner, debiaser=debiaser, option=scorer.option,
                   stages=(0,) if release.first_stage_only else None)
