"""lmms-eval integration: ``--model vtprune_llava`` on the local ``vtprune_shapes`` task through the real CLI.

lmms-eval exits 0 even when evaluation fails, so every check reads the results JSON / samples it wrote, or
its log. The embedded model is copied first: it may be re-exported by a training run at any moment, and the
comparisons below need the same weights in every process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lmms_eval  # noqa: E402,F401  (installed by requirements-dev.txt; a missing install must fail, not skip)
import pytest

IMAGES = 8  # about 47 questions
LIMIT = 48
VIDEO_CLIPS, FRAME_STRIDE = 2, 4
TIMEOUT_S = 420
# Per-type answer priors (yes/no, quadrant, 6 colours, 4 shapes, counts 0-5, numbers) give about 0.22 overall;
# the shipped model scores 0.83 unpruned and 0.80 with fastv at keep 0.25 on 598 test questions.
ACCURACY_FLOOR = 0.6
FASTV_ARGS = "method=fastv,keep=0.25,device=cpu,batch_size=8,threads=1"
QTYPES = ("color", "shape", "count", "exists", "where", "read")

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _snapshot_model(target: Path) -> Path:
    """Copy the embedded LLaVA to ``target``, retrying while a training run is rewriting it."""
    from safetensors import safe_open

    from vtprune.models.embedded import embedded_model_path

    source = embedded_model_path("llava")
    for _ in range(5):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        try:
            with safe_open(str(target / "model.safetensors"), "pt") as weights:
                list(weights.keys())
            return target
        except Exception:  # a half-written file: wait for the writer and copy again
            time.sleep(2)
    raise RuntimeError(f"could not copy a complete embedded model from {source}")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **extra}


def start_lmms(ws: dict, name: str, model_args: str, tasks: str, launcher: list[str] | None = None,
               **env: str) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m lmms_eval`` (optionally under ``launcher``) writing into ``ws['root']/name``."""
    out = ws["root"] / name
    out.mkdir()
    command = [*(launcher or [sys.executable]), "-m", "lmms_eval", "--model", "vtprune_llava",
               "--model_args", f"pretrained={ws['model']},{model_args}", "--tasks", tasks,
               "--include_path", str(ws["tasks"]), "--limit", str(LIMIT), "--output_path", str(out / "results"),
               "--log_samples"]
    with (out / "log.txt").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(**env), cwd=out)
    return process, out


def finish_lmms(process: subprocess.Popen, out: Path) -> dict:
    """Wait for a run; return its results JSON (``None`` if none was written), samples by task and log."""
    try:
        process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    found = sorted(out.rglob("*_results.json"))
    samples = {}
    for path in out.rglob("*_samples_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples[path.stem.split("_samples_", 1)[1]] = sorted(rows, key=lambda row: row["doc_id"])
    return {"results": json.loads(found[-1].read_text()) if found else None, "samples": samples,
            "log": (out / "log.txt").read_text()}


def _metrics(run: dict, task: str = "vtprune_shapes") -> dict[str, Any]:
    assert run["results"] is not None, f"lmms-eval wrote no results; log tail:\n{run['log'][-4000:]}"
    return run["results"]["results"][task]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict:
    """A model snapshot and the prepared local tasks."""
    from vtprune.eval.lmms_plugin.prepare import prepare

    root = tmp_path_factory.mktemp("lmms")
    model = _snapshot_model(root / "model")
    tasks = prepare(root / "tasks", n_images=IMAGES, video_clips=VIDEO_CLIPS, frame_stride=FRAME_STRIDE)
    return {"root": root, "model": model, "tasks": tasks}


@pytest.fixture(scope="module")
def runs(ws) -> dict[str, dict]:
    """The CLI runs, started together (each spends most of its time, about 20 s of CPU, importing lmms-eval and
    indexing its tasks; the evaluations take seconds)."""
    both = "vtprune_shapes,vtprune_shapes_video"
    started = {
        "fastv": start_lmms(ws, "fastv", FASTV_ARGS, both),
        # the unpruned run also runs the multiple_choice task (the loglikelihood path): one process less
        "keep1": start_lmms(ws, "keep1", "method=fastv,keep=1.0,device=cpu,batch_size=8,threads=1",
                            "vtprune_shapes,vtprune_shapes_mc"),
        "bad": start_lmms(ws, "bad", "method=nosuch,keep=0.25,device=cpu", "vtprune_shapes"),
        # accelerate on CPU: the torchrun-style launcher plus ACCELERATE_USE_CPU gives MULTI_CPU ranks on gloo
        "ddp": start_lmms(ws, "ddp", FASTV_ARGS, both, ACCELERATE_LAUNCH, ACCELERATE_USE_CPU="1"),
    }
    done = {name: finish_lmms(*handle) for name, handle in started.items()}
    return {**done, "mc": done["keep1"]}


ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                     "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


# ---------------------------------------------------------------------------------------------------------
# end to end through the CLI
# ---------------------------------------------------------------------------------------------------------
def test_fastv_run_reports_accuracy_and_pruning(runs) -> None:
    run = runs["fastv"]
    metrics = _metrics(run)
    n = run["results"]["n-samples"]["vtprune_shapes"]["effective"]
    assert n == len(run["samples"]["vtprune_shapes"]) >= 40
    assert metrics["exact_match,none"] >= ACCURACY_FLOOR > 0
    for qtype in QTYPES:
        assert 0.0 <= metrics[f"exact_match_{qtype},none"] <= 1.0
    video = _metrics(run, "vtprune_shapes_video")
    assert 0.0 <= video["exact_match,none"] <= 1.0
    stats = run["results"]["throughput"]
    assert stats["avg_vtprune_samples"] == n + len(run["samples"]["vtprune_shapes_video"])
    assert stats["avg_vtprune_kept_fraction"] == pytest.approx(0.25, abs=0.01)
    assert stats["avg_vtprune_visual_tokens"] > 16  # 16 per image, clips hold several frames
    assert stats["avg_vtprune_prefill_ms"] > 0 and stats["avg_vtprune_prefill_ms_per_sample"] > 0


def test_keep_one_matches_vtprune_bench(ws, runs) -> None:
    import torch
    from vtprune.eval.accuracy.bench import evaluate, load_items

    from vtprune.models.loading import load

    run = runs["keep1"]
    metrics = _metrics(run)
    assert run["results"]["throughput"]["avg_vtprune_kept_fraction"] == pytest.approx(1.0)
    model, processor = load(str(ws["model"]), device="cpu")
    items = load_items("test", IMAGES)[:LIMIT]
    with torch.inference_mode():
        records = evaluate(model, processor, items, "none", 1.0, batch_size=8)
    bench = [r["correct"] for r in records]
    lmms = [row["exact_match"] for row in run["samples"]["vtprune_shapes"]]
    assert lmms == bench
    assert metrics["exact_match,none"] == pytest.approx(sum(bench) / len(bench))


def test_multiple_choice_through_the_cli_picks_the_most_likely_answer(runs) -> None:
    """lmms-eval's ``multiple_choice`` sends one loglikelihood request per choice and scores the argmin of the
    returned values: the plugin's pairs reach it intact and are losses (a log probability would pick the least
    likely answer: acc 0.03 instead of 0.95 on these 39 documents). Run unpruned, beside ``keep1``'s task; the
    pruned loglikelihood path is checked in process against the independent reference below."""
    run = runs["mc"]
    metrics = _metrics(run, "vtprune_shapes_mc")
    rows = run["samples"]["vtprune_shapes_mc"]
    assert run["results"]["n-samples"]["vtprune_shapes_mc"]["effective"] == len(rows) >= 30
    assert metrics["acc,none"] >= ACCURACY_FLOOR
    for row in rows:
        scores = [float(value) for value, _ in row["filtered_resps"]]
        best = min(range(len(scores)), key=scores.__getitem__)
        assert all(value > 0 for value in scores)
        assert float(row["acc"]) == float(best == int(row["target"]))


def test_bad_method_fails_with_vtprune_error(runs) -> None:
    run = runs["bad"]
    assert run["results"] is None
    assert "unknown method 'nosuch'" in run["log"]
    assert "Generating test split" not in run["log"]  # failed before any data was loaded


def test_two_processes_match_single_process(runs) -> None:
    run, single = runs["ddp"], runs["fastv"]
    assert "rank 1/2" in run["log"], run["log"][-3000:]
    for task in ("vtprune_shapes", "vtprune_shapes_video"):
        drop = lambda metrics: {k: v for k, v in metrics.items() if "stderr" not in k}  # noqa: E731
        assert drop(_metrics(run, task)) == drop(_metrics(single, task))
        assert [r["filtered_resps"] for r in run["samples"][task]] == \
            [r["filtered_resps"] for r in single["samples"][task]]
    merged, alone = run["results"]["throughput"], single["results"]["throughput"]
    for key in ("avg_vtprune_samples", "avg_vtprune_visual_tokens", "avg_vtprune_kept_tokens"):
        assert merged[key] == pytest.approx(alone[key])


# ---------------------------------------------------------------------------------------------------------
# in process (no CLI)
# ---------------------------------------------------------------------------------------------------------
def test_model_args_are_validated_before_loading() -> None:
    from vtprune.eval.lmms_plugin.args import parse_model_args

    args = parse_model_args({"method": "fastv", "schedule": "1:0.5;2:0.25", "batch_size": 4, "device_map": "cpu"})
    assert [(s.layer, s.keep) for s in args.prune.stages] == [(1, 0.5), (2, 0.25)]
    assert (args.batch_size, args.device, args.pretrained) == (4, "cpu", None)
    with pytest.raises(ValueError, match="keep must be in"):
        parse_model_args({"keep": 1.5})
    with pytest.raises(ValueError, match="unknown method 'nosuch'"):
        parse_model_args({"method": "nosuch"})
    with pytest.raises(ValueError, match="bad options"):
        parse_model_args({"method": "fastv", "alpah": 0.5})
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        parse_model_args({"batch_size": 0})
    with pytest.raises(ValueError, match="LAYER:KEEP"):
        parse_model_args({"schedule": "2-0.5"})
    assert parse_model_args({}).loglikelihood == "loss"
    with pytest.raises(ValueError, match="loglikelihood='nll': use loss"):
        parse_model_args({"loglikelihood": "nll"})


def test_manifests_resolve_to_lmms_classes() -> None:
    from lmms_eval.models.registry_v2 import ModelRegistryV2
    from vtprune.eval.lmms_plugin.manifest import MANIFESTS

    registry = ModelRegistryV2()
    for manifest in MANIFESTS:
        registry.register_manifest(manifest)
    for model_id in ("vtprune_llava", "vtprune_qwen_vl"):
        cls = registry.get_model_class(model_id)
        assert cls.model_id == model_id and cls.is_simple


def test_request_batching_and_stop_strings() -> None:
    from vtprune.eval.lmms_plugin.inputs import batches, cut_at_stop, flatten_visuals, generation_options

    items = [(0, "a", {"max_new_tokens": 4}), (1, "bbb", {"max_new_tokens": 4}), (2, "cc", {"max_new_tokens": 8})]
    assert [[i for i, _, _ in b] for b in batches(items, 1)] == [[1], [0], [2]]
    assert [[i for i, _, _ in b] for b in batches(items, 8)] == [[1, 0], [2]]
    options, until = generation_options({"until": "\n\n", "max_new_tokens": 3, "temperature": 0}, 0)
    assert options == {"max_new_tokens": 3, "do_sample": False, "num_beams": 1, "pad_token_id": 0}
    assert cut_at_stop(" yes\n\nno", until) == "yes"
    with pytest.raises(NotImplementedError, match="video files"):
        flatten_visuals(["clip.mp4"])


def test_loglikelihood_prefers_the_greedy_answer(ws) -> None:
    from lmms_eval.api.instance import Instance
    from vtprune.eval.accuracy.bench import load_items
    from vtprune.eval.lmms_plugin.models import VTPruneLlava

    lm = VTPruneLlava(pretrained=str(ws["model"]), method="fastv", keep=0.25, device="cpu")
    item = next(i for i in load_items("test", 2) if i.qtype == "exists")
    lm.task_dict = {"t": {"test": [{"image": item.image}]}}

    def request(kind: str, target: Any) -> Instance:
        return Instance(kind, (item.question, target, lambda doc: [doc["image"]], 0, "t", "test"), idx=0,
                        metadata={"task": "t", "doc_id": 0, "repeats": 1})

    greedy = lm.generate_until([request("generate_until", {"max_new_tokens": 4})])[0].text
    other = "no" if greedy == "yes" else "yes"
    (loss_greedy, is_greedy), (loss_other, other_greedy) = lm.loglikelihood(
        [request("loglikelihood", " " + greedy), request("loglikelihood", " " + other)])
    # lmms-eval's convention: a loss (lower is more likely); its multiple_choice scoring takes the argmin.
    assert greedy in ("yes", "no") and is_greedy and not other_greedy and 0 < loss_greedy < loss_other
    with pytest.raises(NotImplementedError, match="multi_round"):
        lm.generate_until_multi_round([])
    lm.handle.remove()


@pytest.mark.parametrize("model_id, spec", [("vtprune_llava", "tiny:llava_next"), ("vtprune_qwen_vl", "tiny:qwen2_5_vl")])
def test_other_families_generate_batched(model_id: str, spec: str) -> None:
    from lmms_eval.api.instance import Instance
    from vtprune.eval.lmms_plugin import models

    from vtprune.shapes.task import make_split

    cls = {"vtprune_llava": models.VTPruneLlava, "vtprune_qwen_vl": models.VTPruneQwenVL}[model_id]
    lm = cls(pretrained=spec, method="random", keep=0.5, device="cpu", batch_size=2)
    lm.task_dict = {"t": {"test": [{"image": s.image} for s in make_split("val", 3)]}}
    requests = [Instance("generate_until", (f"<image>\nWhat is it? {k}", {"max_new_tokens": 2}, lambda d: [d["image"]],
                                            k, "t", "test"), idx=0, metadata={"task": "t", "doc_id": k, "repeats": 1})
                for k in range(3)]
    out = lm.generate_until(requests)
    stats = lm.handle.last_stats
    assert len(out) == 3 and all(isinstance(o.text, str) for o in out)
    assert stats.kept[-1] == [max(1, int(v * 0.5 + 0.5)) for v in stats.visual_tokens]
    lm.handle.remove()
    other = models.VTPruneQwenVL if cls is models.VTPruneLlava else models.VTPruneLlava
    with pytest.raises(ValueError, match=f"use --model {model_id}"):
        other(pretrained=spec, device="cpu")


def test_qwen_loglikelihood_feeds_the_continuation_through_the_cache() -> None:
    """Multi-token continuations on M-RoPE models get the model's own 3-D positions (finite result)."""
    from lmms_eval.api.instance import Instance
    from vtprune.eval.accuracy.bench import load_items
    from vtprune.eval.lmms_plugin.models import VTPruneQwenVL

    lm = VTPruneQwenVL(pretrained="tiny:qwen2_5_vl", method="fastv", keep=0.5, device="cpu")
    item = load_items("test", 1)[0]
    lm.task_dict = {"t": {"test": [{"image": item.image}]}}
    request = Instance("loglikelihood", (item.question, " yes no", lambda doc: [doc["image"]], 0, "t", "test"),
                       idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})
    (loss, _), = lm.loglikelihood([request])
    lm.handle.remove()
    assert loss > 0 and loss == loss


# ---------------------------------------------------------------------------------------------------------
# loglikelihood against the independent reference (the logits of a pruned prefill in the input layout)
# ---------------------------------------------------------------------------------------------------------
LOGLIKELIHOOD_CASES = [
    ("vtprune_llava", "tiny:llava", {"method": "fastv", "layer": 2}),
    ("vtprune_llava", "tiny:llava", {"method": "pdrop", "schedule": "1:0.6;2:0.4;3:0.3"}),
    ("vtprune_llava", "tiny:llava", {"method": "divprune"}),
    ("vtprune_llava", "tiny:llava", {"method": "prefixkv"}),
    ("vtprune_qwen_vl", "tiny:qwen2_vl", {"method": "fastv", "layer": 2, "loglikelihood": "logprob"}),
    ("vtprune_qwen_vl", "tiny:qwen2_vl", {"method": "random", "layer": 0, "seed": 3}),
    ("vtprune_qwen_vl", "tiny:qwen2_vl", {"method": "prefixkv"}),
]


def _reference_continuation(model, full: dict, prompt_length: int, stats) -> Any:
    """``[n_cont, V]`` logits predicting each continuation token, recomputed without a cache by
    ``tests/independent_reference.py`` with the visual tokens the plugin's prefill kept."""
    import torch
    from independent_reference import _kv_step, _visual_positions, reference_step

    ids = full["input_ids"]
    prompt = {k: v[:, :prompt_length] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v
              for k, v in full.items()}
    if stats.retained_kv:  # KV retention: layer l's cache keeps kept[l]; the prompt itself sees every token
        visual = _visual_positions(model, ids)
        allowed = []
        for layer_kept in stats.kept_indices:
            keys = torch.ones(prompt_length, dtype=torch.bool)
            keys[visual] = False
            keys[visual[torch.tensor(layer_kept, dtype=torch.long)]] = True
            allowed.append(keys)
        step = lambda current: _kv_step(model, prompt, current, prompt_length, allowed)  # noqa: E731
    else:
        kept = [stage[0] for stage in stats.kept_indices]
        step = lambda current: reference_step(model, prompt, current, stats.stage_layers, kept)  # noqa: E731
    with torch.no_grad():
        return torch.stack([step(ids[:, :n]).float() for n in range(prompt_length, ids.shape[1])])


@pytest.mark.parametrize("model_id, spec, options", LOGLIKELIHOOD_CASES,
                         ids=["-".join([spec.split(":")[1], *map(str, o.values())]) for _, spec, o in LOGLIKELIHOOD_CASES])
def test_loglikelihood_equals_the_independent_reference(model_id: str, spec: str, options: dict) -> None:
    """The plugin's ``(score, is_greedy)`` equals a hand computation: the prompt's kept visual tokens (from the
    plugin's own prefill) and the continuation recomputed without a cache; ``score`` is the mean negative
    log-likelihood per continuation token (``loglikelihood=loss``, default) or the summed log-probability."""
    import torch
    from lmms_eval.api.instance import Instance
    from vtprune.eval.lmms_plugin import models
    from vtprune.eval.lmms_plugin.inputs import encode, prompt_text

    from vtprune.shapes.task import make_split

    cls = {"vtprune_llava": models.VTPruneLlava, "vtprune_qwen_vl": models.VTPruneQwenVL}[model_id]
    lm = cls(pretrained=spec, keep=0.3, device="cpu", **options)
    image = make_split("val", 1)[0].image
    lm.task_dict = {"t": {"test": [{"image": image}]}}
    question, continuations = "What color is the circle?", [" red", " blue circle top left"]
    requests = [Instance("loglikelihood", (question, c, lambda doc: [doc["image"]], 0, "t", "test"), idx=i,
                         metadata={"task": "t", "doc_id": 0, "repeats": 1}) for i, c in enumerate(continuations)]
    results, kept = [], []
    for request in requests:  # one at a time: the stats of each request's prefill
        results += lm.loglikelihood([request])
        kept.append(lm.handle.last_stats)
    lm.handle.remove()
    assert kept[0].kept_indices == kept[1].kept_indices  # every candidate answer is scored on the same kept tokens
    model_type = lm.model.config.model_type
    prompt_length = encode(lm.processor, [prompt_text(lm.processor, model_type, question, 1)], [image])["input_ids"].shape[1]
    for continuation, (score, greedy), stats in zip(continuations, results, kept, strict=True):
        full = encode(lm.processor, [prompt_text(lm.processor, model_type, question, 1) + continuation], [image])
        logits = _reference_continuation(lm.model, full, prompt_length, stats)
        targets = full["input_ids"][0, prompt_length:]
        assert len(targets) >= 1 and stats.kept[-1][0] < stats.visual_tokens[0]  # something was pruned
        logprob = float(torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).sum())
        expected = logprob if options.get("loglikelihood") == "logprob" else -logprob / len(targets)
        assert score == pytest.approx(expected, abs=1e-4)
        assert greedy == bool((logits.argmax(-1) == targets).all())
