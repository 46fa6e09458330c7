"""The data of :mod:`vtprune.eval.papers.reproduce`: the papers' numbers (``papers.csv``), the benchmarks
(lmms-eval task and metric on the papers' scale), the models, and reading a number out of a results file."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vtprune.eval.lmms_plugin.paper_tasks import POPE_TASK, TEXTVQA_OCR_TASK

PAPERS_CSV = Path(__file__).with_name("papers.csv")
DRY_TASK = "vtprune_shapes"
MMBENCH_TASKS = {"judge": "mmbench_en_dev", "static": "mmbench_en_dev_static"}


@dataclass(frozen=True)
class Benchmark:
    """An lmms-eval task and how its reported number is formed: ``scale * sum(metrics)``.

    ``lmms_metrics``: lmms-eval's own number for the same answers where the papers score differently (POPE),
    shown beside the papers' way in the table (same scale).
    """

    task: str
    metrics: tuple[str, ...]
    scale: float = 100.0
    lmms_metrics: tuple[str, ...] = ()


BENCHMARKS = {
    "GQA": Benchmark("gqa", ("exact_match",)),
    "MMB": Benchmark("mmbench_en_dev", ("gpt_eval_score",), 1.0),  # lmms-eval already reports percent
    "MME": Benchmark("mme", ("mme_perception_score", "mme_cognition_score"), 1.0),  # perception + cognition
    "MME-P": Benchmark("mme", ("mme_perception_score",), 1.0),
    "MME-C": Benchmark("mme", ("mme_cognition_score",), 1.0),
    "MMMU": Benchmark("mmmu_val", ("mmmu_acc",)),
    "POPE": Benchmark(POPE_TASK, ("pope_f1_llava",), lmms_metrics=("pope_f1_score",)),
    "SQA-IMG": Benchmark("scienceqa_img", ("exact_match",)),
    "TextVQA": Benchmark(TEXTVQA_OCR_TASK, ("exact_match",)),
}
# A paper's relative score: the mean over these benchmarks of pruned / unpruned (same model), in percent.
RELATIVE = {"REL5": ("GQA", "MMB", "MME", "POPE", "TextVQA")}
# A row's options: RUN_OPTIONS change the run (two rows differing there are two runs), SCORING_OPTIONS only which
# number of a run stands beside the row (``ocr``: TextVQA with or without LLaVA's reference OCR tokens;
# ``pope``: how the paper scored POPE, ``per-split`` as LLaVA's eval_pope.py or ``pooled`` as lmms-eval).
RUN_OPTIONS = {"layer": None, "budget": ("average",), "retain": None}  # None: an integer
SCORING_OPTIONS = {"ocr": ("yes", "no"), "pope": ("per-split", "pooled")}
OPTION_KEYS = (*RUN_OPTIONS, *SCORING_OPTIONS)


@dataclass(frozen=True)
class Model:
    """A checkpoint, its lmms-eval model, its model arguments, its geometry and its stand-in of the dry run.

    ``protocol``: model arguments that reproduce the papers' preprocessing (also applied in the dry run);
    ``tasks``: benchmark -> lmms-eval task where this model's papers used another task variant by default (a
    row's ``ocr=`` option overrides TextVQA's);
    ``visual_tokens`` / ``layers``: visual tokens per image and decoder layers (PyramidDrop average budgets).
    """

    pretrained: str
    lmms_model: str
    args: str
    dry_pretrained: str
    protocol: str = ""
    tasks: tuple[tuple[str, str], ...] = ()
    visual_tokens: int = 576
    layers: int = 32


MODELS = {
    "llava-1.5-7b": Model("llava-hf/llava-1.5-7b-hf", "vtprune_llava", "dtype=float16,attn_implementation=sdpa",
                          "embedded:llava", protocol="image_aspect_ratio=pad,image_backend=pil"),
    # LLaVA-NeXT's published TextVQA (64.9) is without the OCR tokens (haotian-liu/LLaVA#1326: 61.35 with them)
    "llava-next-7b": Model("llava-hf/llava-v1.6-vicuna-7b-hf", "vtprune_llava", "dtype=float16,attn_implementation=sdpa",
                           "tiny:llava_next", protocol="image_backend=pil", tasks=(("TextVQA", "textvqa_val"),),
                           visual_tokens=2880),
    "qwen2.5-vl-7b": Model("Qwen/Qwen2.5-VL-7B-Instruct", "vtprune_qwen_vl",
                           "dtype=bfloat16,attn_implementation=sdpa,min_pixels=200704,max_pixels=1605632",
                           "embedded:qwen2_vl", tasks=(("TextVQA", "textvqa_val"),), layers=28),
}


@dataclass(frozen=True)
class PaperRow:
    """One number of one paper (``value`` None: not transcribed, see ``note``; ``keep`` None: not run).

    ``options``: how the paper ran the method beyond ``keep``, ``;``-separated: ``layer=K`` (the pruning layer)
    or ``budget=average`` (``keep`` is the visual tokens per decoder layer averaged over the layers, as
    PyramidDrop's re-runs count them, not the last stage's share) or ``retain=N`` (a release preset passed to the
    method as is: SparseVLM's ``RETAIN_TOKN``); and how it scored: ``ocr=yes`` / ``ocr=no``
    (TextVQA with or without the reference OCR tokens; default: the model's), ``pope=per-split`` /
    ``pope=pooled`` (LLaVA's POPE F1 or lmms-eval's; default: per-split).
    """

    paper: str
    model: str
    method: str
    keep: float | None
    tokens: str
    benchmark: str
    value: float | None
    source: str
    note: str
    options: str = ""


@dataclass(frozen=True)
class Setting:
    """One lmms-eval run: a model pruned by ``method`` at ``keep`` (``none`` at 1 is the unpruned reference),
    with the row's ``options`` (see :class:`PaperRow`)."""

    model: str
    method: str
    keep: float
    options: str = ""

    @property
    def name(self) -> str:
        suffix = "".join(f"-{part.replace('=', '')}" for part in self.options.split(";") if part)
        return f"{self.model}/{self.method}-{self.keep:g}{suffix}"


def setting_options(options: str) -> str:
    """The part of a row's ``options`` that changes its run (``"layer=2;ocr=yes"`` -> ``"layer=2"``)."""
    return ";".join(part for part in options.split(";") if part and part.split("=", 1)[0] in RUN_OPTIONS)


def row_setting(row: PaperRow) -> Setting | None:
    """The run that measures ``row`` (None: the row is not run); scoring options do not change the run."""
    return None if row.keep is None else Setting(row.model, row.method, row.keep, setting_options(row.options))


def benchmark_task(name: str, model: str, mmbench: str = "judge", options: str = "") -> str:
    """The lmms-eval task of benchmark ``name`` for ``model`` (``mmbench``: ``judge`` or ``static`` scoring;
    ``options``: the row's, whose ``ocr=yes`` / ``ocr=no`` picks TextVQA with or without the OCR tokens)."""
    if name == "MMB":
        return MMBENCH_TASKS[mmbench]
    ocr = parse_options(options).get("ocr")
    if name == "TextVQA" and ocr is not None:
        return TEXTVQA_OCR_TASK if ocr == "yes" else "textvqa_val"
    return dict(MODELS[model].tasks).get(name, BENCHMARKS[name].task)


def parse_options(text: str) -> dict[str, str]:
    """A row's options, ``"layer=3;ocr=no"`` -> ``{"layer": "3", "ocr": "no"}``; ``ValueError`` for anything else
    (the keys are :data:`OPTION_KEYS`: ``layer`` an integer, the others one of their values)."""
    pairs = [part.split("=", 1) for part in text.split(";") if part]
    valid = {**RUN_OPTIONS, **SCORING_OPTIONS}
    for pair in pairs:
        key, value = (pair + [""])[:2]
        if len(pair) != 2 or key not in valid or (valid[key] is None and not value.isdigit()) or (
                valid[key] is not None and value not in valid[key]):
            raise ValueError(f"options {text!r}: use layer=K or retain=N (integers), budget=average, ocr=yes|no, "
                             "pope=per-split|pooled, separated by ';'.")
    return dict(pairs)


def load_papers(path: Path = PAPERS_CSV) -> list[PaperRow]:
    """The papers' numbers; a row naming an unknown model, benchmark or option is an error (a typo in the data)."""
    rows = []
    with open(path, newline="") as handle:
        for line, row in enumerate(csv.DictReader(handle), start=2):
            if row["model"] not in MODELS or (row["benchmark"] not in BENCHMARKS and row["benchmark"] not in RELATIVE):
                raise ValueError(f"{path.name}:{line}: unknown model {row['model']!r} or benchmark {row['benchmark']!r}")
            try:
                parse_options(row.get("options") or "")
            except ValueError as error:
                raise ValueError(f"{path.name}:{line}: {error}") from None
            rows.append(PaperRow(row["paper"], row["model"], row["method"], float(row["keep"]) if row["keep"] else None,
                                 row["tokens"], row["benchmark"], float(row["value"]) if row["value"] else None,
                                 row["source"], row["note"], row.get("options") or ""))
    return rows


def metric(results: dict[str, Any], benchmark: str, dry_run: bool, model: str | None = None,
           mmbench: str = "judge", lmms_way: bool = False, options: str = "") -> float | None:
    """A benchmark's number from a results file, on the papers' scale (the dry run: ``vtprune_shapes`` x 100).

    ``lmms_way``: lmms-eval's own metric where the papers score differently (None where they do not);
    ``options``: the row's (its ``ocr=`` picks the TextVQA task).
    """
    spec = BENCHMARKS[benchmark]
    metrics = spec.lmms_metrics if lmms_way else spec.metrics
    if not metrics:
        return None
    if dry_run:
        task, metrics, scale = DRY_TASK, ("exact_match",), 100.0
    else:
        task, scale = (benchmark_task(benchmark, model, mmbench, options) if model else spec.task), spec.scale
    values = results.get("results", {}).get(task, {})
    found = [next((v for k, v in values.items() if k.split(",")[0] == name and isinstance(v, int | float)), None)
             for name in metrics]
    return None if None in found else scale * sum(found)
