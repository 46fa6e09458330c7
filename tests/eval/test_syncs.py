"""The host-sync counter: every counted op on CPU, zero for plain arithmetic, the filters, hooks-only counting."""

from __future__ import annotations

import pytest
import torch
from vtprune.eval.speed.syncs import count_syncs, watch_hooks

import vtprune

X = torch.arange(6.0)
MASK = X > 2
ONES = torch.ones(6, dtype=torch.long)


def _setitem() -> None:
    y = X.clone()
    y[MASK] = torch.ones(3)


SYNCING = {
    "item": (lambda: X[0].item(), "item"),
    "bool": (lambda: bool(X[1]), "bool"),
    "if tensor": (lambda: 1 if (X > 0).any() else 0, "bool"),
    "int": (lambda: int(X[1]), "int"),
    "float": (lambda: float(X[1]), "float"),
    "__index__": (lambda: [1, 2, 3][torch.tensor(1)], "index"),
    "tolist": (lambda: X.tolist(), "tolist"),
    "numpy": (lambda: X.numpy(), "numpy"),
    "cpu": (lambda: X.cpu(), "cpu"),
    "to('cpu')": (lambda: X.to("cpu"), "to(cpu)"),
    "torch.tensor(device=)": (lambda: torch.tensor([1, 2], device=X.device), "tensor(host->device)"),
    "torch.nonzero": (lambda: torch.nonzero(MASK), "nonzero"),
    "Tensor.nonzero": (lambda: MASK.nonzero(), "nonzero"),
    "argwhere": (lambda: torch.argwhere(MASK), "nonzero"),
    "where(cond)": (lambda: torch.where(MASK), "nonzero"),
    "x[mask]": (lambda: X[MASK], "getitem(bool mask)"),
    "x[mask] = v": (_setitem, "setitem(bool mask)"),
    "masked_select": (lambda: X.masked_select(MASK), "masked_select"),
    "unique": (lambda: torch.unique(X), "unique"),
    "unique_consecutive": (lambda: torch.unique_consecutive(X), "unique"),
    "repeat_interleave(tensor)": (lambda: torch.repeat_interleave(X, ONES), "repeat_interleave"),
    "bincount": (lambda: torch.bincount(ONES), "bincount"),
    "equal": (lambda: torch.equal(X, X), "equal"),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_syncing_op_counts_once(name):
    fn, op = SYNCING[name]
    with count_syncs() as syncs:
        fn()
    assert syncs.total == 1, dict(syncs.by_op)
    assert dict(syncs.by_op) == {op: 1}


def test_syncs_hidden_in_a_composite_are_found_by_the_dispatch_mode():
    with count_syncs() as syncs:
        torch.nn.functional.one_hot(ONES)  # num_classes=-1: reads the max from the tensor
    assert syncs.total >= 1


def test_plain_device_work_counts_zero():
    def work():
        y = (X * 2 + 1).softmax(0)
        z = torch.where(MASK, y, 0.0).cumsum(0)
        z = z[torch.tensor([0, 2])] + torch.arange(2) + torch.full((2,), 3.0)
        z.masked_fill_(z > 1, 0.0)
        torch.repeat_interleave(X, ONES, output_size=6)
        X.repeat_interleave(2)
        X.to(X.device)
        torch.tensor([1, 2])  # stays on the host
        return (z.any(), z.max(), z.shape[0], torch.topk(y, 2).indices)

    with count_syncs() as syncs:
        work()
    assert syncs.total == 0, dict(syncs.by_op)


def test_only_and_group_filter_the_counts():
    flag = [False]
    with count_syncs(only=lambda: flag[0], group=lambda: "inside") as syncs:
        X[0].item()
        flag[0] = True
        X[1].item()
        X.tolist()
    assert syncs.total == 2 and syncs.in_group("inside") == 2 and syncs.in_group("other") == 0
    assert dict(syncs.by_op) == {"item": 1, "tolist": 1}


def test_cuda_synchronize_is_counted_and_restored():
    original = torch.cuda.synchronize
    with count_syncs() as syncs:
        assert torch.cuda.synchronize is not original
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    assert torch.cuda.synchronize is original
    assert syncs.total == int(torch.cuda.is_available())


def test_watch_hooks_counts_inside_vtprune_hooks_only_and_restores_them():
    from vtprune.models.tiny import random_image, tiny_inputs, tiny_model

    model, processor = tiny_model("llava")
    model.generation_config.eos_token_id = None
    inputs = tiny_inputs(processor, "llava", [("what color?", [random_image(56, 56, 0)])])
    with vtprune.apply(model, "fastv", keep=0.5) as handle:
        before = {id(h): h.hooks_dict_ref()[h.id] for h in handle._hooks}
        with watch_hooks(handle) as hooks, count_syncs(only=hooks.inside, group=hooks.phase) as syncs, \
                torch.inference_mode():
            model.generate(**inputs, max_new_tokens=4, do_sample=False)
        after = {id(h): h.hooks_dict_ref()[h.id] for h in handle._hooks}
    assert before == after
    assert hooks.forwards["prefill"] == 1 and hooks.forwards["decode"] == 3
    assert hooks.seconds["prefill"] > 0 and hooks.calls["decode"] > 0
    assert syncs.total == syncs.in_group("prefill") + syncs.in_group("decode")
    assert syncs.in_group("prefill") >= 1  # the prefill reads kept counts back to record statistics
    assert not hasattr(model, "_vtprune_handle")
