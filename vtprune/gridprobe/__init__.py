"""GridProbe for long video (arXiv:2605.10762): frame selection (:mod:`.probe`, pure math) and the runner on a
model (:mod:`.run`: probes, the answer pass pruned by any vtprune method, per-frame budgets, accounting).

An application of the library: nothing in vtprune's core imports it.
"""

from vtprune.gridprobe.probe import (
    FLAT_SD,
    LETTER_FORMS,
    LETTERS,
    Selection,
    candidate_positions,
    effective_k,
    frames_for_shape,
    grid_probes,
    importance_map,
    letter_log_scores,
    letter_posterior,
    letter_token_ids,
    map_moments,
    parse_options,
    probe_confidence,
    question_letters,
    select_cells,
    select_frames,
    shape_score,
    top_cells,
)
from vtprune.gridprobe.run import FRAME_BUDGETS, GridProbeResult, method_config, run_gridprobe, wrap_frames

__all__ = [
    "FLAT_SD", "FRAME_BUDGETS", "GridProbeResult", "LETTERS", "LETTER_FORMS", "Selection", "candidate_positions",
    "effective_k", "frames_for_shape", "grid_probes", "importance_map", "letter_log_scores", "letter_posterior",
    "letter_token_ids", "map_moments", "method_config", "parse_options", "probe_confidence", "question_letters",
    "run_gridprobe", "select_cells", "select_frames", "shape_score", "top_cells", "wrap_frames",
]
