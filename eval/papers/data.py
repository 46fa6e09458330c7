"""The data of :mod:`vtprune.eval.papers.reproduce`: the papers' numbers (``papers.csv``), the benchmarks
(lmms-eval task and metric on the papers' scale), the models, and reading a number out of a results file."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAPERS_CSV = Path(__file__).with_name("papers.csv")
DRY_TASK = "vtprune_shapes"


@dataclass(frozen=True)
class Benchmark:
    """An lmms-eval task and how its reported number is formed: ``scale * sum(metrics)``."""

    task: str
    metrics: tuple[str, ...]
    scale: float = 100.0


BENCHMARKS = {
    "GQA": Benchmark("gqa", ("exact_match",)),
    "MMB": Benchmark("mmbench_en_dev", ("gpt_eval_score",), 1.0),  # lmms-eval already reports percent
    "MME": Benchmark("mme", ("mme_perception_score", "mme_cognition_score"), 1.0),  # perception + cognition
    "MME-P": Benchmark("mme", ("mme_perception_score",), 1.0),
    "POPE": Benchmark("pope", ("pope_f1_score",)),
    "SQA-IMG": Benchmark("scienceqa_img", ("exact_match",)),
    "TextVQA": Benchmark("textvqa_val", ("exact_match",)),
}
# A paper's relative score: the mean over these benchmarks of pruned / unpruned (same model), in percent.
RELATIVE = {"REL5": ("GQA", "MMB", "MME", "POPE", "TextVQA")}


@dataclass(frozen=True)
class Model:
    """A checkpoint, its lmms-eval model, its model arguments, and the embedded model of the dry run."""

    pretrained: str
    lmms_model: str
    args: str
    dry_pretrained: str


MODELS = {
    "llava-1.5-7b": Model("llava-hf/llava-1.5-7b-hf", "vtprune_llava", "dtype=float16,attn_implementation=sdpa",
                          "embedded:llava"),
    "qwen2.5-vl-7b": Model("Qwen/Qwen2.5-VL-7B-Instruct", "vtprune_qwen_vl",
                           "dtype=bfloat16,attn_implementation=sdpa,min_pixels=200704,max_pixels=1605632",
                           "embedded:qwen2_vl"),
}


@dataclass(frozen=True)
class PaperRow:
    """One number of one paper (``value`` None: not transcribed, see ``note``; ``keep`` None: not run)."""

    paper: str
    model: str
    method: str
    keep: float | None
    tokens: str
    benchmark: str
    value: float | None
    source: str
    note: str


@dataclass(frozen=True)
class Setting:
    """One lmms-eval run: a model pruned by ``method`` at ``keep`` (``none`` at 1 is the unpruned reference)."""

    model: str
    method: str
    keep: float

    @property
    def name(self) -> str:
        return f"{self.model}/{self.method}-{self.keep:g}"


def load_papers(path: Path = PAPERS_CSV) -> list[PaperRow]:
    """The papers' numbers; a row naming an unknown model or benchmark is an error (a typo in the data)."""
    rows = []
    with open(path, newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            if row["model"] not in MODELS or (row["benchmark"] not in BENCHMARKS and row["benchmark"] not in RELATIVE):
                raise ValueError(f"{path.name}:{line}: unknown model {row['model']!r} or benchmark {row['benchmark']!r}")
            rows.append(PaperRow(row["paper"], row["model"], row["method"], float(row["keep"]) if row["keep"] else None,
                                 row["tokens"], row["benchmark"], float(row["value"]) if row["value"] else None,
                                 row["source"], row["note"]))
    return rows


def metric(results: dict[str, Any], benchmark: str, dry_run: bool) -> float | None:
    """A benchmark's number from a results file, on the papers' scale (the dry run: ``vtprune_shapes`` x 100)."""
    spec = BENCHMARKS[benchmark]
    task, metrics, scale = (DRY_TASK, ("exact_match",), 100.0) if dry_run else (spec.task, spec.metrics, spec.scale)
    values = results.get("results", {}).get(task, {})
    found = [next((v for k, v in values.items() if k.split(",")[0] == name and isinstance(v, int | float)), None)
             for name in metrics]
    return None if None in found else scale * sum(found)
