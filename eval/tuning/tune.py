"""``vtprune tune``: search a method's hyperparameters under an average-retention budget (VFlowOpt Sec. 3.4).

Objective (spec 4.5): the mean cosine similarity between the final hidden state (after the language
model's final norm) of the last prompt token with and without pruning, over ``n`` unlabeled calibration
prompts (vtprune-shapes ``calib`` split), one prefill forward per configuration. Each method declares its
search space (:mod:`vtprune.eval.tuning.spaces`) and the parameters of its default
configuration (enqueued as trial 0, whose value is ``baseline_objective``). Optuna TPE, seeded.

The output JSON ``{"method", "wrap_options", "objective", "baseline_objective", "trials", ...}`` is read by
``vtprune run --config FILE`` and :func:`vtprune.method_config.load_method_config`.
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from vtprune.cli.checks import ATTN_IMPLEMENTATIONS, DTYPE_NAMES, check_output_file, int_range, keep_fraction
from vtprune.cli.outputs import check_new_file
from vtprune.config import PruneConfig, check_keep

if TYPE_CHECKING:  # imported where used: `vtprune tune --help` imports no torch
    import torch


def prompts(n: int, seed: int) -> list[tuple[Any, str]]:
    """``n`` seeded (image, question) pairs from the vtprune-shapes ``calib`` split."""
    import random

    from vtprune.shapes.task import make_split

    rng = random.Random(seed)
    samples = make_split("calib", n, offset=1000 * seed)
    return [(s.image, rng.choice(s.questions).text) for s in samples]


def last_hidden(model: Any, inputs: dict) -> torch.Tensor:
    """``[B, D]`` fp32 output of the language model's final norm at the last prompt position (left padding)."""
    import torch
    from vtprune.adapters import get_adapter

    captured: dict[str, torch.Tensor] = {}

    def grab(module: Any, args: tuple, output: torch.Tensor) -> None:
        captured["h"] = output[:, -1].float()

    hook = get_adapter(model).language_model.norm.register_forward_hook(grab)
    try:
        with torch.inference_mode():
            model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    return captured["h"]


class Objective:
    """Mean cosine similarity to the unpruned model's last-token state for one configuration."""

    def __init__(self, model: Any, processor: Any, items: list, batch_size: int = 32) -> None:
        import torch

        from vtprune.models.pipeline import build_inputs

        device = next(model.parameters()).device
        self.model, self.batches = model, []
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            inputs = build_inputs(processor, [im for im, _ in chunk], [q for _, q in chunk], model.config.model_type)
            self.batches.append({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        self.reference = [last_hidden(model, inputs) for inputs in self.batches]

    def __call__(self, method: str, budget: float, options: dict[str, Any]) -> float:
        import torch

        import vtprune

        total, count = 0.0, 0
        with vtprune.apply(self.model, method, keep=budget, **options):
            for inputs, reference in zip(self.batches, self.reference, strict=True):
                hidden = last_hidden(self.model, inputs)
                total += float(torch.nn.functional.cosine_similarity(hidden, reference, dim=-1).sum())
                count += hidden.shape[0]
        return total / count


def tune(model: Any, processor: Any, method: str, budget: float, trials: int, n_samples: int = 30,
         seed: int = 0, progress: bool = True, batch_size: int = 32) -> dict[str, Any]:
    """Run the search; returns the JSON-ready result (best options, objectives, every trial)."""
    import optuna  # optional dependency (the bench extra), loaded only to tune
    from vtprune.adapters import get_adapter
    from vtprune.eval.tuning import spaces as tune_spaces

    from vtprune.methods import resolve
    from vtprune.methods.budget import InfeasibleBudget

    check_keep(budget, name="budget")
    if trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}.")
    config = PruneConfig(method=method, keep=budget)
    extra = {"debias": config.debias} if config.debias else {}
    scorer = resolve(config.method, debias=config.debias, model=model)
    adapter = get_adapter(model)
    layers = adapter.num_layers
    objective = Objective(model, processor, prompts(n_samples, seed), batch_size)
    first = tune_spaces.defaults(scorer, budget, layers, adapter)
    tune_spaces.space(scorer, optuna.trial.FixedTrial(first), budget, layers, adapter)  # infeasible: raises now

    def run(trial: optuna.Trial) -> float:
        try:
            options = {**tune_spaces.space(scorer, trial, budget, layers, adapter), **extra}
        except InfeasibleBudget as error:
            raise optuna.TrialPruned(str(error)) from error
        trial.set_user_attr("wrap_options", options)
        return objective(method, budget, options)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.enqueue_trial(first)
    bar = tqdm(total=trials, desc=f"tune {method}", disable=not progress)
    study.optimize(run, n_trials=trials, callbacks=[lambda study, trial: bar.update(1)])
    bar.close()
    done = [t for t in study.trials if t.value is not None]
    if not done:
        raise ValueError(f"no feasible configuration of {method} reaches budget {budget}; raise --budget.")
    best = study.best_trial
    first = study.trials[0]
    return {
        "method": config.method, "budget": budget, "wrap_options": best.user_attrs["wrap_options"],
        "objective": best.value, "baseline_objective": first.value,
        "baseline_options": first.user_attrs.get("wrap_options"),
        "trials": [{"number": t.number, "value": t.value, "params": t.params, "state": t.state.name,
                    "wrap_options": t.user_attrs.get("wrap_options")} for t in study.trials],
        "objective_definition": "mean cosine(final-norm hidden of the last prompt token, pruned vs unpruned)",
        "n_samples": n_samples, "seed": seed,
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tune", help="optimise a method's hyperparameters under an average-retention budget")
    parser.add_argument("--model", default=None, help="folder / hub id, 'embedded:llava' (default), 'tiny:<type>'")
    parser.add_argument("--method", default="vflowopt", help="method to tune (any; 'fastv+debias' ok)")
    parser.add_argument("--budget", type=keep_fraction, default=0.25,
                        help="average fraction of visual tokens over the decoder layers (VFlowOpt's R̄), in (0, 1]")
    parser.add_argument("--trials", type=int_range(1, 100_000), default=50, help="optuna trials")
    parser.add_argument("--n-samples", type=int_range(1, 100_000), default=30, help="calibration prompts (default 30)")
    parser.add_argument("--seed", type=int_range(0), default=0, help="optuna sampler seed")
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="prompts per forward pass")
    parser.add_argument("--out", required=True, help="output JSON (use it with `vtprune run --config FILE`)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file (default: refuse)")
    parser.add_argument("--attn", default="sdpa", choices=ATTN_IMPLEMENTATIONS, help="attn_implementation")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="weights dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.set_defaults(func=command_tune)


def command_tune(args: argparse.Namespace) -> int:
    import vtprune
    from vtprune.cli.options import Pruning, check_pruning
    from vtprune.models.loading import check_load, load, model_label

    out = check_new_file(check_output_file(args.out), args.force)
    check_load(args.model, args.device, args.attn, args.dtype)
    check_pruning(Pruning(args.method, args.budget))
    model, processor = load(args.model, args.attn, args.dtype, args.device)
    result = tune(model, processor, args.method, args.budget, args.trials, args.n_samples, args.seed,
                  batch_size=args.batch_size)
    result.update({"model": model_label(args.model), "vtprune_version": vtprune.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['method']} at budget {args.budget}: objective {result['objective']:.4f} "
          f"(default configuration {result['baseline_objective']:.4f})")
    print(f"wrap options: {json.dumps(result['wrap_options'])}")
    print(f"wrote {out}")
    return 0
