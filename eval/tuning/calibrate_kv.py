"""``vtprune calibrate --method prefixkv``: a model's PrefixKV profile (per-layer eviction ratios per budget).

As the released PrefixKV configurations: on calibration prompts the unpruned model runs once each; every
layer's key priorities are recorded (the scorer's own ``received_attention``); for each budget of the grid
the per-layer counts of :func:`vtprune.methods.prefixkv.layer_budgets` give per-sample eviction ratios
``1 - kept_l / N``, and the profile stores their mean over the prompts. ``wrap(..., profile=FILE)`` then
uses fixed per-layer ratios (interpolated between budgets) instead of a search per call.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

import vtprune
from vtprune.kv import evictable_mask
from vtprune.methods.prefixkv import PROFILE_FORMAT, PrefixKV, layer_budgets
from vtprune.models.pipeline import build_inputs
from vtprune.scoring import ScoreContext

BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class PriorityRecorder(PrefixKV):
    """PrefixKV's priorities, recorded per layer for every sample (the call itself keeps every token)."""

    name: ClassVar[str] = "prefixkv-recorder"
    records: list = field(default_factory=list)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        priority = super().score(ctx)
        if ctx.layer_index == 0:
            self.records.append({"evictable": evictable_mask(ctx, self.scope, self.start).cpu(), "layers": []})
        self.records[-1]["layers"].append(priority.float().cpu())
        return priority


def profile(model: Any, processor: Any, items: list, scope: str = "visual", start: int = 1,
            query_rows: int | None = None, batch_size: int = 16, budgets: tuple[float, ...] = BUDGETS,
            model_name: str = "", progress: bool = True) -> dict[str, Any]:
    """The JSON-ready PrefixKV profile of ``model`` on ``items`` (image, question) pairs."""
    recorder = PriorityRecorder(scope=scope, start=start, query_rows=query_rows)
    device = next(model.parameters()).device
    with vtprune.apply(model, recorder, keep=1.0) as handle:
        for begin in tqdm(range(0, len(items), batch_size), desc="calibrate prefixkv", disable=not progress):
            chunk = items[begin:begin + batch_size]
            inputs = build_inputs(processor, [im for im, _ in chunk], [q for _, q in chunk], model.config.model_type)
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            with torch.inference_mode():
                model(**inputs, logits_to_keep=1)
        num_layers = handle.adapter.num_layers
    sums = {b: torch.zeros(num_layers, dtype=torch.float64) for b in budgets}
    samples = 0
    for record in recorder.records:
        priorities = torch.stack(record["layers"])  # [layers, B, L]
        for row in range(priorities.shape[1]):
            evictable = record["evictable"][row]
            n = int(evictable.sum())
            if n == 0:
                continue
            samples += 1
            for budget in budgets:
                kept = torch.tensor(layer_budgets(priorities[:, row][:, evictable], budget), dtype=torch.float64)
                sums[budget] += 1.0 - kept / n
    if samples == 0:
        raise ValueError("no calibration prompt had evictable tokens (images or, with scope='prompt', a prompt).")
    return {"format": PROFILE_FORMAT, "version": 1, "model": model_name, "model_type": model.config.model_type,
            "num_layers": num_layers, "scope": scope, "start": start, "query_rows": query_rows,
            "budgets": {f"{b:g}": [round(float(r), 6) for r in sums[b] / samples] for b in budgets},
            "ratio": "fraction of the evictable tokens each layer evicts (mean over the calibration prompts)",
            "n_samples": samples, "vtprune_version": vtprune.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
