"""Speed side by side with Tencent AngelSlim's token_compressor: ``python -m vtprune.eval.speed.peers``.

The methods both ship (AngelSlim's ``factory.py`` names in brackets): random (``random``), fastv
(``special_token_based_attention``), divprune, dart, visionzip, vispruner,
hiprune, scope and idpruner (IDPruner with the same untrained stand-in selector on both sides). Per method, the same weights and inputs (the embedded LLaVA; a random-weight LLaVA-1.5 proxy, 576
visual tokens and a narrow language model, :mod:`vtprune.eval.speed.proxy`) and the same greedy
``generate(max_new_tokens=N)`` run with ``vtprune.wrap(model, method, keep=k)`` and with AngelSlim's compressor
at ratio ``1 - k``, batch 1, interleaved: every round runs each sample on four sides (vtprune, the unpruned
model beside it, AngelSlim, the unpruned model beside it) in an order that rotates, after one warm-up round.

AngelSlim runs in a worker process of its own (:mod:`vtprune.eval.speed.peers_worker`, started with
``--angelslim-python``): its token_compressor is written for transformers 5.x before 5.19 (5.6 runs it here)
and vtprune needs 5.19+. Each side is therefore also compared with the unpruned model on its own transformers
(``speedup_*`` columns); the worker loads the same weights (the embedded model's folder, the proxy saved by this
process). Without an importable AngelSlim only the vtprune side is measured and a line says so.

Recorded per run: time to first token (prefill), end-to-end ``generate``, per-token decode, peak resident-set
growth, visual tokens the last decoder layer sees and the generated tokens (answers compared up to the first
end-of-sequence token). Methods: FastV (Chen et al., ECCV 2024, arXiv:2403.06764), DivPrune (Alvar et al., CVPR
2025, arXiv:2503.02175), DART (Wen et al., arXiv:2502.11494), VisionZip (Yang et al., CVPR 2025,
arXiv:2412.04467), VisPruner (Zhang et al., ICCV 2025, arXiv:2412.01818), HiPrune (Liu et al.,
arXiv:2508.00553).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from vtprune.eval.speed.peers_worker import PAIRS, timed_run

SKIP_LINE = "[peers] AngelSlim's token_compressor is not importable ({reason}): measuring the vtprune side only"
SIDES = ("vtprune", "dense", "angelslim", "angelslim_dense")
WORKER = Path(__file__).with_name("peers_worker.py")


class Worker:
    """The AngelSlim worker process: one JSON command per line in, one JSON answer per line out."""

    def __init__(self, python: str, src: str | None, threads: int, log: Path) -> None:
        cmd = [python, str(WORKER), "--threads", str(threads)] + (["--angelslim-src", src] if src else [])
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the AngelSlim worker exited (rc {self.proc.poll()}); see {self._log.name}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.ask_quit()
            self.proc.wait(timeout=60)
        self._log.close()

    def ask_quit(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()


def embedded_setup(samples: int) -> tuple[object, list[dict], str, str]:
    """The embedded LLaVA, ``samples`` batch-1 inputs (a test image and its first question each), its folder and
    a label."""
    import vtprune
    from vtprune.models.embedded import embedded_model_path
    from vtprune.shapes.task import make_split

    model, processor = vtprune.load("embedded:llava", device="cpu")
    inputs = []
    for sample in make_split("test", samples):
        content = [{"type": "image"}, {"type": "text", "text": sample.questions[0].text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs.append(dict(processor(images=[sample.image], text=[prompt], return_tensors="pt")))
    return model, inputs, str(embedded_model_path("llava")), "embedded:llava (16 visual tokens, LM 192x4)"


def proxy_setup(hidden: int, layers: int, folder: Path) -> tuple[object, list[dict], str, str]:
    """The random-weight LLaVA-1.5 proxy (576 visual tokens, LM ``hidden x layers``) saved to ``folder``."""
    from vtprune.eval.speed.proxy import GEOMETRIES, batch_inputs, build_model, lm_geometry

    lm = lm_geometry("llava", "proxy", hidden, layers)
    model = build_model("llava", lm, "sdpa", torch.float32, "cpu")
    model.save_pretrained(folder)
    inputs = [batch_inputs(model, GEOMETRIES["576"], 1, lm, "cpu")]
    return model, inputs, str(folder), f"proxy llava-1.5 (576 visual tokens, LM {hidden}x{layers}, random weights)"


def measure(model, inputs: list[dict], method: str, keep: float, worker: Worker | None, repeats: int,
            new_tokens: int) -> dict[str, list[dict]]:
    """``{side: [run, ...]}`` over ``repeats`` rounds after a warm-up round (runs of ``timed_run``)."""
    import vtprune

    pair = PAIRS[method]
    local = {"vtprune": lambda: vtprune.apply(model, method=method, keep=keep, **pair.options),
             "dense": contextlib.nullcontext}
    sides = [s for s in SIDES if s in local or worker is not None]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for round_ in range(repeats + 1):
        for i, sample in enumerate(inputs):
            shift = (round_ + i) % len(sides)
            for side in sides[shift:] + sides[:shift]:
                if side in local:
                    run = timed_run(model, sample, new_tokens, local[side])
                else:
                    run = worker.ask(op="run", side=side.replace("angelslim_dense", "dense"), method=method,
                                     keep=keep, sample=i, new_tokens=new_tokens)
                run["sample"] = i
                if round_ > 0 or "error" in run:
                    runs[side].append(run)
    return runs


def run_model(kind: str, args: argparse.Namespace, worker: Worker | None, scratch: Path) -> list[dict]:
    """Rows of every method on one model (``"embedded"`` or ``"proxy"``)."""
    from vtprune.eval.speed.peers_report import summarise

    if kind == "embedded":
        model, inputs, folder, label = embedded_setup(args.samples)
    else:
        model, inputs, folder, label = proxy_setup(args.proxy_hidden, args.proxy_layers, scratch / "proxy")
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    model.generation_config.eos_token_id = None  # exactly N new tokens on every side
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    probes: dict[str, str] = {}
    if worker is not None:
        torch.save(inputs, scratch / f"{kind}-inputs.pt")
        loaded = worker.ask(op="load", model_dir=folder, inputs=str(scratch / f"{kind}-inputs.pt"), attn="sdpa",
                            dtype="float32", eos_token_id=None)
        if "error" in loaded:
            raise RuntimeError(f"the AngelSlim worker could not load {folder}: {loaded['error']}")
        if kind == "embedded":
            probes = {m: worker.ask(op="probe", method=m, keep=args.keep)["result"] for m in args.methods}
    rows = []
    for method in args.methods:
        print(f"[peers] {kind} {method} keep {args.keep}", file=sys.stderr, flush=True)
        runs = measure(model, inputs, method, args.keep, worker, args.repeats, args.new_tokens)
        rows += summarise(kind, label, method, args, runs, eos, probes.get(method, ""))
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    import vtprune
    from vtprune.cli.checks import OneLineParser, check_output_dir, keep_fraction, positive_int

    parser = OneLineParser(prog="python -m vtprune.eval.speed.peers", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded,proxy", help="embedded, proxy or both (default)")
    parser.add_argument("--methods", default=None, help="comma-separated (default: every method both libraries ship"
                        " that vtprune registers: " + ",".join(PAIRS) + ")")
    parser.add_argument("--keep", type=keep_fraction, default=0.25, help="fraction of visual tokens kept (0.25)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed rounds after the warm-up (5)")
    parser.add_argument("--new-tokens", type=positive_int, default=8, help="greedy new tokens per generate (8)")
    parser.add_argument("--samples", type=positive_int, default=4, help="embedded-model inputs (4)")
    parser.add_argument("--proxy-hidden", type=positive_int, default=512, help="proxy LM width (512)")
    parser.add_argument("--proxy-layers", type=positive_int, default=8, help="proxy LM depth (8)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads on each side (1)")
    parser.add_argument("--angelslim-python", default=sys.executable,
                        help="python of an environment with transformers 5.6-5.18 (default: this one)")
    parser.add_argument("--angelslim-src", default=None,
                        help="folder holding angelslim/compressor/token_compressor (a Tencent/AngelSlim checkout; "
                             "its REVISION file, if any, is recorded)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/peers-angelslim"), help="output folder")
    parser.add_argument("--force", action="store_true", help="replace the results already in --out")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    registered = set(vtprune.list_methods())
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else [m for m in PAIRS if m in registered]
    bad = [m for m in models if m not in ("embedded", "proxy")] or [m for m in methods if m not in PAIRS]
    missing = [m for m in methods if m not in registered]
    if bad or not models or not methods:
        parser.error(f"unknown or empty --models / --methods {bad or ''}; use embedded,proxy and a subset of "
                     f"{','.join(PAIRS)}.")
    if missing:
        parser.error(f"--methods {','.join(missing)}: not registered in this vtprune; drop it or update vtprune.")
    if shutil.which(args.angelslim_python) is None:
        parser.error(f"--angelslim-python {args.angelslim_python!r} is not an executable; give the python of the "
                     "environment AngelSlim runs in (see docs/results/peers-angelslim/README.md).")
    check_output_dir(args.out)
    if (args.out / "peers.csv").exists() and not args.force:
        parser.error(f"--out {str(args.out)!r} already holds peers.csv; give another folder or --force to replace.")
    args.models, args.methods = models, methods
    return args


def main(argv: list[str] | None = None) -> int:
    from vtprune.eval.speed.peers_report import write_results

    args = parse(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="vtprune-peers-") as tmp:
        scratch = Path(tmp)
        worker = Worker(args.angelslim_python, args.angelslim_src, args.threads, scratch / "worker.log")
        if not worker.hello.get("ok"):
            print(SKIP_LINE.format(reason=worker.hello.get("reason", "unknown")), flush=True)
            worker.close()
            worker_info, worker = dict(worker.hello), None
        else:
            worker_info = dict(worker.hello)
        import transformers

        args.versions = {"vtprune": transformers.__version__, "angelslim": worker_info.get("transformers", "")}
        try:
            rows = [row for kind in args.models for row in run_model(kind, args, worker, scratch)]
        finally:
            if worker is not None:
                worker.close()
    write_results(rows, args, worker_info)
    print(f"[peers] wrote {args.out}/peers.csv, peers.md, peers.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
