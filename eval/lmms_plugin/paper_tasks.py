"""lmms-eval task variants that score as the papers did: TextVQA with the reference OCR tokens, POPE's F1 per split.

Each variant is a YAML that ``include``\\ s the installed lmms-eval task and changes one thing, written by
:func:`write_paper_tasks` into a folder for ``--include_path`` (``vtprune bench reproduce`` does it for you):

* ``vtprune_textvqa_val_ocr``: ``textvqa_val`` with ``ocr: true``. LLaVA-1.5's evaluation
  (``scripts/v1_5/eval/textvqa.sh``) reads ``llava_textvqa_val_v051_ocr.jsonl``, whose prompt is the question, a
  ``Reference OCR token: a, b, ...`` line and the answer instruction; lmms-eval's ``textvqa_val`` leaves the
  OCR line out (``ocr: false``), which costs about 12 points on LLaVA-1.5 (EvolvingLMMs-Lab/lmms-eval#6
  and #51). lmms-eval's ``ocr: true`` writes the line even for an image without OCR tokens (an empty
  ``Reference OCR token: ``); LLaVA's file has no such line there (two lines), so the variant's prompt is
  :func:`textvqa_ocr_doc_to_text`. Scoring is lmms-eval's (the VQA soft accuracy, as LLaVA's ``eval_textvqa.py``).
* ``vtprune_pope``: ``pope`` with one more metric, ``pope_f1_llava``: LLaVA's ``llava/eval/eval_pope.py`` keeps the
  answer's first sentence, drops commas and reads "no" when a word is ``No``, ``no`` or ``not`` (else "yes"),
  computes F1 on each split (adversarial, popular, random) and the papers report the mean of the three.
  lmms-eval's ``pope_f1_score`` (kept beside it) pools the splits and counts only an exact ``yes``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

TEXTVQA_OCR_TASK = "vtprune_textvqa_val_ocr"
POPE_TASK = "vtprune_pope"
POPE_LMMS_METRICS = ("pope_accuracy", "pope_precision", "pope_recall", "pope_f1_score", "pope_yes_ratio")
HERE = "vtprune.eval.lmms_plugin.paper_tasks"


def lmms_task_file(folder: str, name: str) -> Path:
    """The installed lmms-eval task YAML ``lmms_eval/tasks/<folder>/<name>``; ``FileNotFoundError`` if absent."""
    import lmms_eval.tasks

    path = Path(lmms_eval.tasks.__file__).resolve().parent / folder / name
    if not path.is_file():
        raise FileNotFoundError(f"lmms-eval has no {folder}/{name} at {path}; install the pinned lmms-eval "
                                "(pip install -c constraints.txt -e '.[eval]').")
    return path


def _textvqa_kwargs(source: Path) -> dict[str, Any]:
    """lmms-eval's ``lmms_eval_specific_kwargs`` of ``textvqa_val`` with ``ocr`` switched on for every model."""
    from lmms_eval.utils import load_yaml_config

    kwargs = json.loads(json.dumps(load_yaml_config(str(source), mode="simple").get("lmms_eval_specific_kwargs") or {}))
    kwargs.setdefault("default", {})
    for values in kwargs.values():
        values["ocr"] = True
    return kwargs


def write_paper_tasks(out: str | Path) -> Path:
    """Write ``vtprune_textvqa_val_ocr.yaml`` and ``vtprune_pope.yaml`` into ``out``; returns the folder."""
    import yaml

    folder = Path(out).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    textvqa = lmms_task_file("textvqa", "textvqa_val.yaml")
    header = "# Written by vtprune (vtprune.eval.lmms_plugin.paper_tasks); rerun it rather than editing.\n"
    body = yaml.safe_dump({"include": str(textvqa), "task": TEXTVQA_OCR_TASK,
                           "lmms_eval_specific_kwargs": _textvqa_kwargs(textvqa)}, sort_keys=False)
    prompt = f"doc_to_text: !function {HERE}.textvqa_ocr_doc_to_text\n"
    (folder / f"{TEXTVQA_OCR_TASK}.yaml").write_text(header + body + prompt)
    metrics = "".join(f"  - metric: {name}\n    aggregation: !function lmms_eval.tasks.pope.utils."
                      f"pope_aggregate_{name.removeprefix('pope_')}\n    higher_is_better: true\n"
                      for name in POPE_LMMS_METRICS)
    (folder / f"{POPE_TASK}.yaml").write_text(
        header + f"include: {json.dumps(str(lmms_task_file('pope', 'pope.yaml')))}\ntask: {POPE_TASK}\n"
        f"process_results: !function {HERE}.pope_process_results\nmetric_list:\n{metrics}"
        f"  - metric: pope_f1_llava\n    aggregation: !function {HERE}.pope_f1_llava\n    higher_is_better: true\n")
    return folder


def textvqa_ocr_doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """LLaVA-1.5's TextVQA prompt (``llava_textvqa_val_v051_ocr.jsonl``): the question (first letter capitalised,
    as lmms-eval and LLaVA's file write it), a ``Reference OCR token: a, b`` line only when the image has OCR
    tokens, then the answer instruction: three lines, or two for an image without OCR tokens."""
    kwargs = lmms_eval_specific_kwargs or {}
    tokens = [str(token) for token in doc.get("ocr_tokens") or []]
    ocr = f"\nReference OCR token: {', '.join(tokens)}" if tokens and kwargs.get("ocr", True) else ""
    return f"{kwargs.get('pre_prompt', '')}{doc['question'].capitalize()}{ocr}{kwargs.get('post_prompt', '')}"


# -- POPE as LLaVA scores it ---------------------------------------------------------------------------------
def llava_yes_no(answer: str) -> str:
    """``"no"`` if the answer's first sentence (commas removed, split on spaces) has the word ``No``, ``no`` or
    ``not`` (exactly, case-sensitive), else ``"yes"`` (LLaVA's ``eval_pope.py``): "No, there is none." -> no,
    "There is not." -> no, "Not really." -> yes ("Not" is not one of the words), "Nope" -> yes, "no." -> no."""
    words = answer.split(".")[0].replace(",", "").split(" ")
    return "no" if {"No", "no", "not"} & set(words) else "yes"


def pope_process_results(doc: dict, results: list[Any]) -> dict[str, Any]:
    """lmms-eval's POPE metrics plus ``pope_f1_llava``'s record (split, LLaVA's yes/no, the label)."""
    from lmms_eval.tasks.pope.utils import pope_process_results as lmms_pope

    answer = str(results[0]) if results else ""
    record = {"category": str(doc.get("category") or "all"), "prediction": llava_yes_no(answer),
              "label": str(doc["answer"]).strip().lower()}
    return {**lmms_pope(doc, results), "pope_f1_llava": record}


def f1(records: list[dict]) -> float:
    """F1 of "yes" (positive) over ``records`` (``prediction``, ``label``); 0 when precision + recall is 0."""
    tp = sum(r["prediction"] == "yes" and r["label"] == "yes" for r in records)
    fp = sum(r["prediction"] == "yes" and r["label"] != "yes" for r in records)
    fn = sum(r["prediction"] != "yes" and r["label"] == "yes" for r in records)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def pope_f1_llava(records: list[dict]) -> float:
    """The mean over POPE's splits (the documents' ``category``) of each split's F1, as the papers report it
    (documents without a ``category`` form one split: a warning says so)."""
    splits: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        splits[record["category"]].append(record)
    if set(splits) == {"all"}:
        from loguru import logger

        logger.warning("vtprune_pope: the documents carry no 'category' (split); pope_f1_llava is the pooled F1.")
    return sum(f1(split) for split in splits.values()) / len(splits) if splits else 0.0
