"""Check a vLLM source tree for the private APIs the plugin uses, without importing vLLM.

``python -m vtprune.vllm.api_check [VLLM_DIR]`` (default: the installed ``vllm`` package's folder, found without
importing it) reads vLLM's Python files as syntax trees, so it also checks a vLLM that cannot be imported here (vLLM
0.33 needs torch 2.14; unpack its wheel with ``pip download --no-deps vllm==0.33.0`` and ``unzip``). Two kinds of
checks: every ``from vllm.X import Y`` in ``vtprune/vllm`` (``Y`` defined or imported at the top of ``X``), and
:data:`MEMBERS`, the methods, fields and attributes the seam modules reach (docs/serving.md lists the seams), with
the leading parameter names the plugin passes. One line per check; the exit status is 1 when one fails.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

PLUGIN_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Member:
    """``module`` (path under the vllm folder) defines class ``owner`` with ``name`` (a method with ``params`` as
    its leading parameter names, ``""`` for any name, or a field / ``self.name =`` attribute when ``params`` is None). ``alternative``:
    another member name that serves instead (a spelling of another tested minor)."""

    module: str
    owner: str
    name: str
    params: tuple[str, ...] | None = None
    alternative: str = ""


_KV = "v1/core/single_type_kv_cache_manager.py"
_BACKEND = "v1/attention/backend.py"
_RUNNER = "v1/worker/gpu_model_runner.py"
_PROCESSOR = "multimodal/processing/processor.py"
_COMMON_FIELDS = ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
                  "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping", "causal",
                  "seq_lens_cpu_upper_bound", "is_prefilling")
_IMPL = ("self", "layer", "key", "value", "kv_cache", "slot_mapping")
#: What the seam modules reach beyond their imports (layerwise/kv.py, scheduler.py, retention_scheduler.py,
#: metadata.py, retention.py, runtime.py, config.py; the model modules' processor and model hooks).
MEMBERS: tuple[Member, ...] = (
    Member("v1/kv_cache_spec_registry.py", "KVCacheSpecRegistry", "register", ("cls", "", "", "uniform_type_base_spec")),
    Member("v1/kv_cache_spec_registry.py", "KVCacheSpecRegistry", "_ensure_registered", ("cls",)),
    Member(_KV, "SingleTypeKVCacheManager", "get_num_blocks_to_allocate",
           ("self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
            "num_local_computed_tokens", "num_tokens_main_model")),
    Member(_KV, "SingleTypeKVCacheManager", "allocate_new_blocks",
           ("self", "request_id", "num_tokens", "num_tokens_main_model")),
    Member(_KV, "SingleTypeKVCacheManager", "cache_blocks", ("self", "request", "num_tokens")),
    Member(_KV, "FullAttentionManager", "find_longest_cache_hit",
           ("cls", "block_hashes", "max_length", "kv_cache_group_ids", "block_pool", "kv_cache_spec")),
    Member("v1/kv_cache_interface.py", "KVCacheSpec", "block_size"),
    Member("v1/core/sched/scheduler.py", "Scheduler", "add_request", ("self", "request")),
    Member("v1/core/sched/scheduler.py", "Scheduler", "_free_request", ("self", "request")),
    Member("v1/core/sched/scheduler.py", "Scheduler", "_reserve_prefill_lookahead",
           ("self", "request", "num_computed_tokens", "num_new_tokens")),
    Member("v1/request.py", "Request", "skip_reading_prefix_cache"),
    Member("v1/request.py", "Request", "mm_features"),
    Member("v1/request.py", "Request", "num_prompt_tokens"),
    *(Member(_BACKEND, "CommonAttentionMetadata", name) for name in _COMMON_FIELDS),
    Member("v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl", "do_kv_cache_update", _IMPL),
    Member("v1/attention/backends/flash_attn.py", "FlashAttentionImpl", "do_kv_cache_update", _IMPL),
    Member("v1/attention/backends/flashinfer.py", "FlashInferImpl", "do_kv_cache_update", _IMPL),
    Member("v1/worker/utils.py", "AttentionGroup", "build_metadata", ("self", "common_attn_metadata"),
           alternative="get_metadata_builder"),
    Member("v1/worker/utils.py", "AttentionGroup", "layer_names"),
    Member("v1/worker/block_table.py", "BlockTable", "get_device_tensor", ("self", "num_reqs")),
    Member("v1/worker/block_table.py", "BlockTable", "block_table"),
    Member("forward_context.py", "ForwardContext", "attn_metadata"),
    Member("forward_context.py", "ForwardContext", "slot_mapping"),
    Member("model_executor/layers/attention/attention.py", "Attention", "forward", ("self", "query", "key", "value")),
    Member("model_executor/layers/attention/attention.py", "Attention", "get_kv_cache_spec", ("self", "vllm_config")),
    *(Member("model_executor/layers/attention/attention.py", "Attention", name)
      for name in ("layer_name", "head_size", "kv_cache", "impl")),
    *(Member(_RUNNER, "GPUModelRunner", name) for name in ("attn_groups", "input_batch", "query_start_loc",
                                                          "requests", "is_multimodal_pruning_enabled",
                                                          "kv_cache_config")),
    *(Member("v1/worker/gpu_input_batch.py", "InputBatch", name) for name in (
        "req_ids", "num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table")),
    *(Member(_PROCESSOR, "BaseMultiModalProcessor", name) for name in ("_apply_hf_processor_main",
                                                                      "_get_mm_fields_config", "_get_prompt_updates")),
    Member("model_executor/models/interfaces.py", "SupportsMultiModalPruning", "recompute_mrope_positions"),
    *(Member("config/parallel.py", "ParallelConfig", name) for name in (
        "pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size", "enable_dbo")),
    *(Member("config/scheduler.py", "SchedulerConfig", name) for name in (
        "scheduler_cls", "async_scheduling", "disable_hybrid_kv_cache_manager")),
    Member("config/cache.py", "CacheConfig", "enable_prefix_caching"),
    Member("config/model.py", "ModelConfig", "enforce_eager"),
    Member("config/model.py", "ModelConfig", "logits_processors"),
    # PrefixKV's freed blocks (kv.py, retention_scheduler.py, retention.py)
    Member(_KV, "SingleTypeKVCacheManager", "pop_blocks_for_free", ("self", "request_id")),
    Member(_KV, "SingleTypeKVCacheManager", "req_to_blocks"),
    Member(_KV, "SingleTypeKVCacheManager", "block_pool"),
    Member("v1/core/block_pool.py", "BlockPool", "free_blocks", ("self", "ordered_blocks")),
    Member("v1/kv_cache_interface.py", "KVCacheSpec", "is_uniform_with_collection", ("self", "kv_cache_specs")),
    Member("v1/core/sched/scheduler.py", "Scheduler", "update_from_output",
           ("self", "scheduler_output", "model_runner_output")),
    Member(_RUNNER, "GPUModelRunner", "sample_tokens", ("self",)),
    Member(_RUNNER, "GPUModelRunner", "execute_model", ("self", "scheduler_output")),
    Member(_RUNNER, "GPUModelRunner", "capture_model", ("self",)),
    Member("v1/worker/gpu_input_batch.py", "CachedRequestState", "block_ids"),
    *(Member("v1/worker/block_table.py", "BlockTable", name) for name in ("num_blocks_per_row", "block_size")),
    # hook-free decode and graph settings (decode.py, ops.py, config.py)
    Member("v1/worker/utils.py", "AttentionGroup", "metadata_builders"),
    Member(_BACKEND, "AttentionMetadataBuilder", "update_block_table", ("self", "metadata", "blk_table", "slot_mapping")),
    Member(_BACKEND, "AttentionMetadataBuilder", "supports_update_block_table"),
    Member("forward_context.py", "ForwardContext", "no_compile_layers"),
    Member("config/vllm.py", "VllmConfig", "additional_config"),
    *(Member("config/compilation.py", "CompilationConfig", name) for name in ("mode", "cudagraph_mode")),
    Member("platforms/interface.py", "Platform", "support_static_graph_mode", ("cls",)),
)


def _tree(path: Path) -> ast.Module | None:
    return ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else None


def module_file(root: Path, dotted: str) -> Path:
    """The file of module ``dotted`` (``vllm.a.b``) under ``root`` (the ``vllm`` package folder)."""
    parts = dotted.split(".")[1:]
    plain = root.joinpath(*parts).with_suffix(".py") if parts else root / "__init__.py"
    return plain if plain.is_file() else root.joinpath(*parts, "__init__.py")


def package_of(root: Path, dotted: str) -> str:
    """The package a module's relative imports start from: itself for a package, else its parent."""
    return dotted if module_file(root, dotted).name == "__init__.py" else dotted.rpartition(".")[0]


def top_names(tree: ast.Module, root: Path | None = None, package: str = "vllm", depth: int = 3) -> set[str]:
    """Names a module binds at its top level (defs, classes, assignments, imports; ``if`` blocks included), with
    what its ``from .x import *`` re-exports (``root``: the vllm folder, ``package``: the module's package)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["*"]:
            if root is not None and depth > 0:
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                dotted = ".".join(base + ([node.module] if node.module else []))
                starred = _tree(module_file(root, dotted))
                if starred is not None:
                    names |= top_names(starred, root, package_of(root, dotted), depth - 1)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def plugin_imports(plugin_dir: Path = PLUGIN_DIR) -> list[tuple[str, str, str]]:
    """``(vtprune file, vllm module, name)`` of every ``from vllm... import name`` under ``plugin_dir``."""
    out = []
    for path in sorted(plugin_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                out.extend((path.relative_to(plugin_dir.parents[1]).as_posix(), node.module, a.name) for a in node.names)
    return out


def _class(tree: ast.Module | None, owner: str) -> ast.ClassDef | None:
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == owner:
            return node
    return None


def _find(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """The method ``name`` of ``cls``, its class-level field, or a ``self.name =`` assignment in one of its methods."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) and t.value.id == "self":
                return node
    return None


def check_member(root: Path, member: Member) -> str:
    """``""`` when ``member`` holds in the tree at ``root``, ``"(as NAME)"`` when its alternative does, else why not
    (one phrase)."""
    cls = _class(_tree(root / member.module), member.owner)
    if cls is None:
        return f"no class {member.owner} in vllm/{member.module}"
    node = _find(cls, member.name)
    if node is None and member.alternative and _find(cls, member.alternative) is not None:
        return f"(as {member.alternative})"
    if node is None:
        return f"{member.owner} has no {member.name}"
    if member.params is not None:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return f"{member.owner}.{member.name} is not a method"
        names = tuple(a.arg for a in node.args.posonlyargs + node.args.args)
        if len(names) < len(member.params) or any(w and w != n for w, n in zip(member.params, names)):
            return f"{member.owner}.{member.name}{names} does not start with {member.params}"
    return ""


def check_tree(root: Path, plugin_dir: Path = PLUGIN_DIR) -> list[tuple[str, str]]:
    """``(check, problem)`` for every check of the vLLM package folder ``root``; ``problem`` is ``""`` when it
    holds (``"(as NAME)"`` when a member's alternative does)."""
    out = []
    for source, module, name in plugin_imports(plugin_dir):
        tree = _tree(module_file(root, module))
        problem = (f"no module {module}" if tree is None else "" if name in top_names(tree, root, package_of(root, module))
                   else f"{module} does not define {name}")
        out.append((f"{source}: from {module} import {name}", problem))
    for member in MEMBERS:
        label = f"vllm/{member.module}: {member.owner}.{member.name}"
        out.append((label + (f"{member.params}" if member.params else ""), check_member(root, member)))
    return out


def installed_vllm() -> Path:
    """The installed ``vllm`` package's folder (not imported), or a one-line ``SystemExit``."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vtprune: no vllm installed here; pass the unpacked vllm package folder, e.g. "
                         "python -m vtprune.vllm.api_check /tmp/vllm-0.33.0/vllm")
    return Path(list(spec.submodule_search_locations)[0])


def version_of(root: Path) -> str:
    """The version in ``root/_version.py`` (``__version__ = ...``), or ``"unknown"``."""
    tree = _tree(root / "_version.py")
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("__version__", "version")
                                                for t in node.targets) and isinstance(node.value, ast.Constant):
            return str(node.value.value)
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else installed_vllm()
    if not (root / "__init__.py").is_file():
        raise SystemExit(f"vtprune: {root} is not a vllm package folder (no __init__.py); pass the folder that "
                         "holds vllm's __init__.py.")
    results = check_tree(root)
    failed = 0
    for label, problem in results:
        holds = not problem or problem.startswith("(as ")
        failed += not holds
        print(f"{'ok     ' if holds else 'MISSING'} {label}" + (f" {problem}" if holds and problem else f": {problem}" if problem else ""))
    print(f"vLLM {version_of(root)} at {root}: {len(results) - failed} of {len(results)} checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
