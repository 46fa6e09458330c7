"""GridProbe: training-free frame selection by probing a frozen VLM on a K x K frame grid.

GridProbe (arXiv:2605.10762). ``K^2`` candidate frames sit on a K x K grid in time order
(frame ``r*K + c`` in cell ``(r, c)``). K row probes (contiguous chunks) and K column probes (strided frames)
run through the frozen selector model at a reduced resolution; each probe's confidence is its peak answer
posterior. ``M = R c^T`` (row x column confidences) ranks the cells and Shape-Adaptive Selection sizes the
budget from the map's skew and excess kurtosis::

    shape = |skew| + 0.5 * max(0, kurt),   M_eff = clip(ceil(K^2 / (1 + s * shape)), M_min, M_max)

(s = 3, M_min = 2, M_max = K^2; a flat map, sd < 1e-10, keeps all K^2 frames). The top ``M_eff`` cells, in
time order, go to one full-resolution answer pass (:mod:`vtprune.gridprobe.run`).

Confidence: for multiple-choice questions, the letter log-score is the logsumexp of the log-probabilities of
the first tokens of the surface forms ``L`` ``" L"`` ``"(L"`` ``"L."`` ``" L."`` ``"L)"``, restricted to the
letters that exist and renormalised with a softmax; the confidence is the largest letter probability. A
first token shared by several letters (e.g. a bare space in byte-level BPE) says nothing about the letter and
is dropped. Open-ended questions (no options) use the largest softmax probability of the first answer token.

Everything here is a pure function of tensors or lists; the model runner lives in ``gridprobe_run``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

LETTER_FORMS = ("{}", " {}", "({}", "{}.", " {}.", "{})")
LETTERS = "ABCDEFGHIJ"
FLAT_SD = 1e-10


# -- the grid --------------------------------------------------------------------------------------------------
def effective_k(num_frames: int, k: int) -> int:
    """The grid side used for ``num_frames`` frames: ``min(k, floor(sqrt(num_frames)))`` (needs ``K^2`` frames)."""
    if k < 1:
        raise ValueError(f"the GridProbe grid side K must be >= 1, got {k}.")
    return min(k, math.isqrt(max(num_frames, 0)))


def candidate_positions(num_frames: int, k: int) -> list[int]:
    """Positions of the ``K^2`` candidates among ``num_frames`` frames: ``round(linspace(0, T-1, K^2))``."""
    cells = k * k
    if num_frames < cells:
        raise ValueError(f"{num_frames} frames cannot fill a {k}x{k} grid; use effective_k().")
    if cells == 1:
        return [0]
    return [int(round(i * (num_frames - 1) / (cells - 1))) for i in range(cells)]


def grid_probes(k: int) -> list[list[int]]:
    """The 2K probes as lists of cell indices: rows ``[rK .. rK+K-1]`` first, then columns ``[c, c+K, ..]``."""
    rows = [[r * k + c for c in range(k)] for r in range(k)]
    columns = [[r * k + c for r in range(k)] for c in range(k)]
    return rows + columns


# -- confidences ---------------------------------------------------------------------------------------------
def letter_token_ids(tokenizer, letters: Sequence[str]) -> list[list[int]]:
    """Per letter, the first-token ids of its surface forms that no other letter's forms start with."""
    firsts = []
    for letter in letters:
        ids = set()
        for form in LETTER_FORMS:
            encoded = tokenizer.encode(form.format(letter), add_special_tokens=False)
            if encoded:
                ids.add(int(encoded[0]))
        firsts.append(ids)
    result = []
    for i, ids in enumerate(firsts):
        others = set().union(*(f for j, f in enumerate(firsts) if j != i)) if len(firsts) > 1 else set()
        unique = sorted(ids - others)
        if not unique:
            raise ValueError(f"the tokenizer cannot tell option {letters[i]!r} from the others by its first token.")
        result.append(unique)
    return result


def letter_log_scores(log_probs: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    """``[P, n]`` letter log-scores: logsumexp of ``log_probs`` ``[P, V]`` over each letter's token ids."""
    return torch.stack([torch.logsumexp(log_probs[:, ids], dim=-1) for ids in token_ids], dim=-1)


def letter_posterior(logits: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    """``[P, n]`` posterior over the existing letters from last-position logits ``[P, V]``."""
    scores = letter_log_scores(torch.log_softmax(logits.float(), dim=-1), token_ids)
    return torch.softmax(scores, dim=-1)


def probe_confidence(logits: torch.Tensor, token_ids: list[list[int]] | None) -> torch.Tensor:
    """``[P]`` peak letter posterior (multiple choice) or peak first-token probability (``token_ids=None``)."""
    if token_ids is None:
        return torch.softmax(logits.float(), dim=-1).max(dim=-1).values
    return letter_posterior(logits, token_ids).max(dim=-1).values


def parse_options(text: str) -> list[tuple[str, str]]:
    """``"A) red;B) blue"`` / ``"A. red; B. blue"`` / ``"red;blue"`` -> ``[("A", "red"), ("B", "blue")]``."""
    items = [item.strip() for item in re.split(r"[;\n]", text) if item.strip()]
    if len(items) < 2:
        raise ValueError(f"--options needs at least two options separated by ';', got {text!r}.")
    if len(items) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options are supported, got {len(items)}.")
    parsed = []
    for i, item in enumerate(items):
        match = re.match(r"^\(?([A-J])[.):]\s*(.*)$", item)
        letter, body = (match.group(1), match.group(2)) if match else (LETTERS[i], item)
        parsed.append((letter, body.strip()))
    letters = [letter for letter, _ in parsed]
    if len(set(letters)) != len(letters):
        raise ValueError(f"option letters repeat in {text!r}.")
    return parsed


def question_letters(question: str) -> list[str]:
    """Letters ``A, B, ...`` listed as ``"A. x B. y"`` / ``"(A) x"`` / ``"A) x"`` in ``question`` (>= 2, from A)."""
    found = re.findall(r"(?:^|[\s(])([A-J])[.)]\s", question + " ")
    letters = []
    for letter in found:
        if letter == LETTERS[len(letters)]:
            letters.append(letter)
    return letters if len(letters) >= 2 else []


# -- map and Shape-Adaptive Selection --------------------------------------------------------------------------
def importance_map(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``[K, K]`` rank-1 map ``M[r, c] = rows[r] * columns[c]`` (float64)."""
    return torch.outer(rows.double(), columns.double())


def map_moments(values: torch.Tensor) -> tuple[float, float, float]:
    """``(sd, skew, excess kurtosis)`` of all values (population moments); skew = kurtosis = 0 when flat."""
    flat = values.double().flatten()
    centred = flat - flat.mean()
    sd = float(centred.pow(2).mean().sqrt())
    if sd < FLAT_SD:
        return sd, 0.0, 0.0
    skew = float(centred.pow(3).mean() / sd**3)
    kurt = float(centred.pow(4).mean() / sd**4 - 3.0)
    return sd, skew, kurt


def shape_score(skew: float, kurt: float, kurt_weight: float = 0.5) -> float:
    """``|skew| + kurt_weight * max(0, kurt)``: how far the map is from flat coverage."""
    return abs(skew) + kurt_weight * max(0.0, kurt)


def frames_for_shape(shape: float, cells: int, s: float = 3.0, m_min: int = 2, m_max: int | None = None) -> int:
    """``clip(ceil(cells / (1 + s * shape)), m_min, m_max)`` with ``m_max = cells`` by default."""
    m_max = cells if m_max is None else min(m_max, cells)
    raw = math.ceil(cells / (1.0 + s * shape) - 1e-9)
    return max(1, min(m_max, max(m_min, raw)))


def top_cells(values: torch.Tensor, m: int) -> list[int]:
    """The ``m`` highest cells of the flattened map (ties to the earlier cell), returned in time order."""
    flat = values.double().flatten()
    order = torch.sort(-flat, stable=True).indices[:m]
    return sorted(int(i) for i in order)


@dataclass
class Selection:
    """Outcome of Shape-Adaptive Selection on one K x K grid (cells index the candidates in time order)."""

    k: int
    row_confidence: list[float]
    column_confidence: list[float]
    importance: list[list[float]]
    m_eff: int
    cells: list[int]
    skew: float
    kurtosis: float
    shape: float
    flat: bool


def select_cells(rows: Sequence[float], columns: Sequence[float], s: float = 3.0, m_min: int = 2,
                 m_max: int | None = None) -> Selection:
    """Shape-Adaptive Selection from K row and K column confidences."""
    r, c = torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(columns, dtype=torch.float64)
    if r.numel() != c.numel() or r.numel() == 0:
        raise ValueError(f"need K row and K column confidences, got {r.numel()} and {c.numel()}.")
    k = r.numel()
    grid = importance_map(r, c)
    sd, skew, kurt = map_moments(grid)
    flat = sd < FLAT_SD
    shape = 0.0 if flat else shape_score(skew, kurt)
    if flat:  # every cell is as good as any other: all of them, or an even spread under an m_max cap
        m_eff = max(1, min(k * k, m_max or k * k))
        step = (k * k - 1) / max(m_eff - 1, 1)
        cells = [int(round(i * step)) for i in range(m_eff)]
    else:
        m_eff = frames_for_shape(shape, k * k, s, m_min, m_max)
        cells = top_cells(grid, m_eff)
    return Selection(k, r.tolist(), c.tolist(), grid.tolist(), m_eff, cells, skew, kurt, shape, flat)


def select_frames(k: int, score_probes: Callable[[list[list[int]]], Sequence[float]], s: float = 3.0,
                  m_min: int = 2, m_max: int | None = None) -> Selection:
    """Run the 2K probes through ``score_probes`` (cell lists -> 2K confidences) and select cells."""
    probes = grid_probes(k)
    confidence = [float(v) for v in score_probes(probes)]
    if len(confidence) != 2 * k:
        raise ValueError(f"score_probes must return {2 * k} confidences, got {len(confidence)}.")
    return select_cells(confidence[:k], confidence[k:], s, m_min, m_max)
