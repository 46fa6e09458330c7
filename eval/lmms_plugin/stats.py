"""What pruning did during an lmms-eval run, reported through lmms-eval's own model-metrics channel.

The model calls :func:`lmms_eval.models.model_utils.gen_metrics.log_metrics` once per request type (one
``generate_until`` call holds every generation request of the run). lmms-eval keeps those records and
writes their summary into the results JSON under ``"throughput"``, prefixing extra keys with ``avg_``:

``avg_vtprune_visual_tokens`` / ``avg_vtprune_kept_tokens``: mean visual tokens per sample before pruning
and after the last stage; ``avg_vtprune_kept_fraction``; ``avg_vtprune_prefill_ms``: mean measured prefill
(vision tower + LM prompt forward of one ``generate`` batch, ``handle.last_stats.forward_ms``);
``avg_vtprune_prefill_ms_per_sample``; ``avg_vtprune_samples``; ``avg_vtprune_batch_size``.

Under ``accelerate launch`` every rank counts its own shard and the sums are all-gathered before logging,
so rank 0 (the one that writes the results file) reports the whole run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class RunStats:
    """Sums over the samples of one request type on this rank."""

    samples: int = 0
    visual_tokens: int = 0
    kept_tokens: int = 0
    prefill_ms: float = 0.0
    prefills: int = 0
    prefill_samples: int = 0
    gen_tokens: int = 0
    elapsed_s: float = 0.0

    def add_call(self, call_stats: Any, rows: int, gen_tokens: int, elapsed_s: float) -> None:
        """Count one ``generate`` / forward call of ``rows`` samples; ``call_stats`` is its ``CallStats``."""
        self.samples += rows
        self.gen_tokens += gen_tokens
        self.elapsed_s += elapsed_s
        if call_stats is None:
            return
        visual = list(call_stats.visual_tokens)[:rows]
        kept = list(call_stats.kept[-1])[:rows] if call_stats.kept else visual
        self.visual_tokens += int(sum(visual))
        self.kept_tokens += int(sum(kept))
        if call_stats.forward_ms is not None:
            self.prefill_ms += float(call_stats.forward_ms)
            self.prefills += 1
            self.prefill_samples += rows

    def merged(self) -> RunStats:
        """The sums over every rank (all-gathered when ``torch.distributed`` runs more than one process)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, asdict(self))
        total = RunStats()
        for part in gathered:
            for f in fields(RunStats):
                setattr(total, f.name, getattr(total, f.name) + part[f.name])
        return total

    def metrics(self, batch_size: int) -> dict[str, float]:
        """The ``vtprune_*`` numbers logged for this request type."""
        def ratio(a: float, b: float) -> float:
            return a / b if b else float("nan")

        return {
            "vtprune_samples": self.samples,
            "vtprune_visual_tokens": ratio(self.visual_tokens, self.samples),
            "vtprune_kept_tokens": ratio(self.kept_tokens, self.samples),
            "vtprune_kept_fraction": ratio(self.kept_tokens, self.visual_tokens),
            "vtprune_prefill_ms": ratio(self.prefill_ms, self.prefills),
            "vtprune_prefill_ms_per_sample": ratio(self.prefill_ms, self.prefill_samples),
            "vtprune_batch_size": batch_size,
            "total_requests": self.samples,
        }


def log_run_stats(stats: RunStats, batch_size: int, label: str) -> dict[str, float]:
    """Merge ``stats`` over ranks and hand them to lmms-eval's ``log_metrics``; returns the logged numbers."""
    from lmms_eval.models.model_utils.gen_metrics import log_metrics

    total = stats.merged()
    metrics = total.metrics(batch_size)
    if total.samples == 0:
        return metrics
    speed = total.gen_tokens / total.elapsed_s if total.elapsed_s > 0 else 0.0
    log_metrics(total_elapsed_time=total.elapsed_s, total_gen_tokens=total.gen_tokens, avg_speed=speed,
                additional_metrics={"vtprune": label, **metrics})
    return metrics
