"""The AngelSlim side of ``python -m vtprune.eval.speed.peers``, and the timing both sides share.

Runs as a script in an environment of its own (``python eval/speed/peers_worker.py``): AngelSlim's
token_compressor (github.com/Tencent/AngelSlim, ``angelslim/compressor/token_compressor``; written for
transformers 5.x before 5.19, which vtprune requires) needs an older transformers than vtprune, so the driver
starts this file with ``--angelslim-python`` and sends it one JSON command per line on stdin; each answer is
one JSON line on stdout. Imports torch, transformers and (when it can) angelslim only, never vtprune; the
driver imports the same functions (:func:`timed_run`, :class:`LengthProbe`) for the vtprune side, so both
sides are timed by one piece of code.

AngelSlim's settings are its shipped ``configs/llava/pruning/*_r0.75.yaml`` with ``ratio = 1 - keep``; the
ViT layer ``-2`` of those files becomes the model's ``vision_feature_layer`` (:func:`vit_layers`), and the
CLIP path of its ``model_mapping`` follows the installed transformers (:func:`llava_mapping`).

IDPruner (Tan et al., arXiv:2602.13315) ranks tokens with a trained Vision Selector that vtprune does not ship
(AngelSlim's ``idpruner_r0.75.yaml`` leaves ``selector_path`` a placeholder), so both sides get the same
untrained stand-in, :class:`NormScorer` (each token's embedding norm): vtprune as ``selector=``, AngelSlim as a
folder in its selector layout (:func:`standin_selector_folder`). The times compare the two MMR loops around one
selector, not the paper's selector. SCOPE (Deng et al., NeurIPS 2025, arXiv:2510.24214) follows
``scope_r0.75.yaml``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import io
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class Pair:
    """One method as both libraries name and configure it.

    ``stage``: AngelSlim's stage key ("global": before the language model; an int: after that decoder layer).
    ``params`` / ``needs``: AngelSlim's strategy parameters and data requirements, given the pruning ratio ``r``,
    the ViT feature layer ``v`` and object layer ``o`` (:func:`vit_layers`). ``options``: ``vtprune.wrap``
    options that put vtprune's pruning at the same layer.
    """

    method: str
    strategy: str
    stage: str | int
    params: Callable[[float, int, int], dict]
    needs: Callable[[int, int], dict]
    options: dict = field(default_factory=dict)


class NormScorer(torch.nn.Module):
    """The stand-in Vision Selector of the IDPruner pair: raw score = each token's embedding norm (untrained; one
    scale parameter, 1, because AngelSlim reads the selector's dtype from its first parameter).
    ``vision_hidden [B, N, D] -> [B, N]``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, vision_hidden: torch.Tensor) -> torch.Tensor:
        return vision_hidden.norm(dim=-1) * self.scale


@functools.cache
def standin_selector_folder() -> str:
    """A temporary folder (removed at exit) holding :class:`NormScorer` in AngelSlim's Vision Selector layout
    (``config.json`` naming the class, its ``*.py`` source, ``model.bin`` weights), written once per process."""
    folder = Path(tempfile.mkdtemp(prefix="vtprune-peers-selector-"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "config.json").write_text(json.dumps({"architecture": NormScorer.__name__}))
    (folder / "scorer.py").write_text("import torch\n\n\n" + inspect.getsource(NormScorer))
    torch.save(NormScorer().state_dict(), folder / "model.bin")
    return str(folder)


PAIRS: dict[str, Pair] = {p.method: p for p in (
    Pair("random", "random", "global", lambda r, v, o: {"ratio": r}, lambda v, o: {}, {"layer": 0}),
    Pair("fastv", "special_token_based_attention", 0,
         lambda r, v, o: {"ratio": r, "query_source": {"strategy": "last_text"}, "layer_idx": 0},
         lambda v, o: {"llm_q_layers": [0], "llm_k_layers": [0]}, {"layer": 1}),
    Pair("divprune", "divprune", "global", lambda r, v, o: {"ratio": r}, lambda v, o: {"inputs_embeds": True}),
    Pair("dart", "dart", 0,
         lambda r, v, o: {"ratio": r, "pivot_image_token": 4, "pivot_text_token": 4, "use_post_rope": True,
                          "layer_idx": 0},
         lambda v, o: {"feature_map": True, "llm_k_layers": [0]}, {"layer": 1}),
    Pair("visionzip", "visionzip", "global", lambda r, v, o: {"ratio": r, "zip_ratio": 0.15625, "layer_idx": v},
         lambda v, o: {"vit_q_layers": [v], "vit_k_layers": [v], "feature_map": True, "image_grid_thw": True}),
    Pair("vispruner", "vispruner", "global",
         lambda r, v, o: {"ratio": r, "layer_idx": v, "important_ratio_of_kept": 0.5},
         lambda v, o: {"vit_q_layers": [v], "vit_k_layers": [v], "feature_map": True}),
    Pair("hiprune", "hiprune", "global",
         lambda r, v, o: {"ratio": r, "object_layer": o, "last_vit_layer": v, "alpha": 0.1},
         lambda v, o: {"vit_q_layers": sorted({o, v}), "vit_k_layers": sorted({o, v}), "image_grid_thw": True}),
    Pair("scope", "scope", "global", lambda r, v, o: {"ratio": r, "layer_idx": v, "alpha": 1.0},
         lambda v, o: {"vit_q_layers": [v], "vit_k_layers": [v], "feature_map": True}),
    Pair("idpruner", "idpruner", "global",
         lambda r, v, o: {"ratio": r, "mmr_lambda": 0.5, "parallel_k": 1, "selector_path": standin_selector_folder()},
         lambda v, o: {"inputs_embeds": True}, {"selector": NormScorer()}),
)}

LLAVA_MAPPING = [  # AngelSlim configs/llava/pruning/*.yaml, model_mapping
    {"name": "vl_model", "path": "model", "wrapper_module": ".models.llava", "wrapper_class": "Prunable_LlavaModel"},
    {"name": "vision_attn", "path": "model.vision_tower.vision_model.encoder.layers[n].self_attn",
     "wrapper_module": ".models.llava", "wrapper_class": "Prunable_CLIPAttention"},
    {"name": "text_model", "path": "model.language_model", "wrapper_module": ".models.llava",
     "wrapper_class": "Prunable_LlamaModel"},
    {"name": "llm_attn", "path": "model.language_model.layers[n].self_attn", "wrapper_module": ".models.llava",
     "wrapper_class": "Prunable_LlamaAttention"},
]


def llava_mapping(model) -> list[dict]:
    """:data:`LLAVA_MAPPING` with this transformers' CLIP path (5.6+ has no ``CLIPVisionModel.vision_model``)."""
    flat = not hasattr(model.model.vision_tower, "vision_model")
    return [dict(m, path=m["path"].replace(".vision_model.", ".")) if flat else dict(m) for m in LLAVA_MAPPING]


def vit_layers(model) -> tuple[int, int]:
    """``(feature, object)`` ViT layer indices: AngelSlim's ``-2`` (LLaVA-1.5's feature layer) becomes the model's
    ``vision_feature_layer``; HiPrune's object layer 9 of CLIP-L's 24 scales to the tower's depth."""
    depth = model.config.vision_config.num_hidden_layers
    layer = model.config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: the AngelSlim comparison needs a single feature layer.")
    feature = layer % depth if layer < 0 else layer - 1  # hidden_states[k] is layer k-1's output
    return feature, min(feature, round(9 * depth / 24))


def import_token_compressor(src: str | None) -> tuple[object | None, str]:
    """AngelSlim's ``token_compressor`` config module (``src`` first on ``sys.path`` when given), or ``None`` and
    the reason it cannot be imported."""
    if src:
        if not (Path(src) / "angelslim" / "compressor" / "token_compressor").is_dir():
            return None, f"--angelslim-src {src!r} holds no angelslim/compressor/token_compressor"
        sys.path.insert(0, str(src))
    try:
        import angelslim.compressor.token_compressor.adapter  # noqa: F401
        import angelslim.compressor.token_compressor.base.config as config
        import angelslim.compressor.token_compressor.models.llava  # noqa: F401
    except Exception as error:  # ImportError, or an install that raises anything on import
        first = str(error).splitlines()[0] if str(error) else ""
        return None, f"{type(error).__name__}: {first}".rstrip(": ")
    return config, ""


class AngelSide:
    """AngelSlim's compressor on ``model`` inside a ``with`` block (its wrappers removed on exit)."""

    def __init__(self, model, pair: Pair, keep: float, config_module) -> None:
        from angelslim.compressor.token_compressor.adapter import UniversalPruningAdapter

        v, o = vit_layers(model)
        cfg = config_module.TokenCompressorConfig(
            requirements=config_module.DataRequirements(**pair.needs(v, o)),
            strategies={pair.stage: config_module.StrategyConfig(pair.strategy, pair.params(1.0 - keep, v, o))})
        with contextlib.redirect_stdout(io.StringIO()):  # the adapter prints every module it wraps
            self.adapter = UniversalPruningAdapter(model, cfg, llava_mapping(model))

    def __enter__(self) -> AngelSide:
        with contextlib.redirect_stdout(io.StringIO()):
            self.adapter.wrap_model()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.adapter.unwrap_model()


class LengthProbe:
    """The sequence length the last decoder layer sees in the first forward (the prefill) of a ``generate``."""

    def __init__(self, model) -> None:
        self.length: int | None = None
        layer = model.model.language_model.layers[-1]
        self._hook = layer.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        if self.length is None:
            self.length = int((args[0] if args else kwargs["hidden_states"]).shape[1])

    def remove(self) -> None:
        self._hook.remove()


class _Clock:
    """A logits processor that timestamps every ``generate`` step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def _trim() -> None:
    """Hand freed heap pages back to the kernel (glibc ``malloc_trim``), so the resident set before a run holds
    live memory only and its peak growth counts what the run touches; a no-op without glibc."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def timed_run(model, inputs: dict, new_tokens: int, enter: Callable) -> dict:
    """One greedy batch-1 ``generate`` inside ``enter()``: ``ttft_ms`` (to the first token's logits), ``e2e_ms``,
    ``decode_ms`` (per later token), ``peak_bytes`` (peak resident-set growth after ``malloc_trim``), ``kept`` (visual tokens the last
    decoder layer sees) and the new ``tokens``. ``inputs``: ``input_ids [1, L]``, ``pixel_values``, masks."""
    from transformers import LogitsProcessorList

    probe, clock = LengthProbe(model), _Clock()
    try:
        with enter(), torch.inference_mode():
            _trim()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set (VmHWM) to the current size
            before = _rss("VmRSS")
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([clock]))
            end = time.perf_counter()
            peak = _rss("VmHWM") - before
    finally:
        probe.remove()
    prompt = inputs["input_ids"].shape[1]
    visual = int((inputs["input_ids"] == model.config.image_token_id).sum())
    steps = max(1, len(clock.stamps) - 1)
    return {"ttft_ms": (clock.stamps[0] - start) * 1e3, "e2e_ms": (end - start) * 1e3,
            "decode_ms": (clock.stamps[-1] - clock.stamps[0]) * 1e3 / steps, "peak_bytes": peak,
            "visual": visual, "kept": probe.length - (prompt - visual), "tokens": out[0, prompt:].tolist()}


def batch_probe(model, inputs: list[dict], pair: Pair, keep: float, config_module) -> str:
    """``"ok"`` when AngelSlim's compressor generates for a batch of two equal-length inputs, else its error."""
    if len(inputs) < 2 or inputs[0]["input_ids"].shape != inputs[1]["input_ids"].shape:
        return "not tried (needs two equal-length inputs)"
    batch = {k: torch.cat([inputs[0][k], inputs[1][k]]) for k in inputs[0]}
    try:
        with AngelSide(model, pair, keep, config_module), torch.inference_mode():
            model.generate(**batch, max_new_tokens=2, do_sample=False)
    except Exception as error:  # AssertionError / NotImplementedError raised inside AngelSlim
        first = str(error).splitlines()[0] if str(error) else ""
        return f"{type(error).__name__}: {first}".rstrip(": ")
    return "ok"


def handle(cmd: dict, state: dict, config_module) -> dict:
    """One command: ``load`` (``model_dir``, ``inputs`` file, ``attn``, ``dtype``), ``run`` (``side``: angelslim or
    dense, ``method``, ``keep``, ``sample``, ``new_tokens``) or ``probe`` (AngelSlim at batch 2)."""
    if cmd["op"] == "load":
        from transformers import LlavaForConditionalGeneration

        state["model"] = LlavaForConditionalGeneration.from_pretrained(
            cmd["model_dir"], attn_implementation=cmd["attn"], dtype=getattr(torch, cmd["dtype"])).eval()
        generation = state["model"].generation_config
        generation.eos_token_id = cmd.get("eos_token_id")
        generation.pad_token_id = generation.pad_token_id if generation.pad_token_id is not None else 0
        state["inputs"] = torch.load(cmd["inputs"])
        return {"ok": True}
    model, pair = state["model"], PAIRS[cmd["method"]]
    if cmd["op"] == "probe":
        return {"result": batch_probe(model, state["inputs"], pair, cmd["keep"], config_module)}
    if cmd["side"] == "angelslim":
        return timed_run(model, state["inputs"][cmd["sample"]], cmd["new_tokens"],
                         lambda: AngelSide(model, pair, cmd["keep"], config_module))
    return timed_run(model, state["inputs"][cmd["sample"]], cmd["new_tokens"], contextlib.nullcontext)


def serve(src: str | None, threads: int) -> int:
    """Answer the driver's JSON commands (:func:`handle`; ``quit`` ends) one line each."""
    out, sys.stdout = sys.stdout, sys.stderr  # AngelSlim prints; only answers go to the real stdout
    torch.set_num_threads(threads)
    config_module, reason = import_token_compressor(src)
    import transformers

    def answer(payload: dict) -> None:
        out.write(json.dumps(payload) + "\n")
        out.flush()

    answer({"ok": config_module is not None, "reason": reason, "transformers": transformers.__version__,
            "torch": torch.__version__})
    state: dict = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            answer(handle(cmd, state, config_module))
        except Exception as error:  # reported to the driver, which records it in the row
            answer({"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="AngelSlim side of vtprune.eval.speed.peers (JSON on stdin)")
    parser.add_argument("--angelslim-src", default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.exit(serve(args.angelslim_src, args.threads))
