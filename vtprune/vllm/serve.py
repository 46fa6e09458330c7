"""``vtprune serve``: vLLM's OpenAI-compatible server with vtprune's plugin (pre-LLM pruning), one command.

``vtprune serve [MODEL] --method divprune --keep 0.25 [vLLM options]`` checks the settings here (one line,
exit 2), turns ``embedded:llava`` / ``embedded:qwen2_vl`` into a folder vLLM loads, and runs
``python -m vllm.entrypoints.openai.api_server`` in the Python that has vLLM: this one, ``$VTPRUNE_VLLM_PYTHON``,
or the venv ``scripts/setup_vllm.sh`` makes. Options it does not know go to vLLM unchanged. No vLLM import here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from vtprune.errors import UserError
from vtprune.vllm.settings import IMAGE_METHODS, VllmPruning, check_architecture

DEFAULT_MODEL = "embedded:llava"
EPILOG = """\
examples:
  vtprune serve                                          the embedded LLaVA, divprune keep 0.25, port 8000
  vtprune serve embedded:qwen2_vl --keep 0.5 --trust-request-mm-kwargs    clients may send vtprune_keep
  vtprune serve llava-hf/llava-1.5-7b-hf --dtype float16 --tensor-parallel-size 8     vLLM options pass through
needs vLLM: pip install -e ".[vllm]" (GPU, in the clone) or bash scripts/setup_vllm.sh (CPU); see
docs/serving.md."""
VENV_PYTHON = Path.home() / ".cache" / "vtprune" / "venv-vllm-0.32.0" / "bin" / "python"


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="start vLLM's OpenAI-compatible server with pre-LLM pruning",
                                  epilog=EPILOG)
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help="embedded:llava, embedded:qwen2_vl, a model folder or a Hub id (LLaVA-1.5, LLaVA-NeXT, "
                            "LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    serve.add_argument("--method", default="divprune", help="divprune, random, temporal (Qwen2-VL / Qwen2.5-VL video), "
                       "visionzip (LLaVA-1.5, Qwen-VL) or vflowopt (the same families, images; its pre-LLM "
                       "stage, no recycling): the methods vLLM allows")
    serve.add_argument("--keep", type=float, default=0.25, help="fraction of each image's visual tokens kept")
    serve.add_argument("--seed", type=int, default=0, help="seed of --method random")
    serve.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    serve.add_argument("--port", type=int, default=8000, help="port the server listens on")
    serve.add_argument("--dry-run", action="store_true", help="print the vLLM command line and exit")
    serve.set_defaults(func=command_serve, passthrough=[])


def has_vllm() -> bool:
    """Whether this Python can import vLLM (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_python() -> str:
    """A Python that imports vLLM, or a one-line :class:`UserError` naming the install."""
    given = os.environ.get("VTPRUNE_VLLM_PYTHON")
    if given:
        return given
    if has_vllm():
        return sys.executable
    if VENV_PYTHON.exists():
        return str(VENV_PYTHON)
    raise UserError("vLLM is not installed: run `bash scripts/setup_vllm.sh` (CPU, its own venv) or "
                    "`pip install -e \".[vllm]\"` in the vtprune clone (GPU; no constraints file: vLLM pins transformers 5.19), "
                    "then `vtprune serve` again.")


def architecture_of(folder: str) -> str | None:
    """``architectures[0]`` of a model folder's (or Hub id's) config, ``None`` if it cannot be read."""
    config = Path(folder) / "config.json"
    if config.is_file():
        return (json.loads(config.read_text()).get("architectures") or [None])[0]
    try:  # a Hub id: its config (downloaded or cached)
        from transformers import AutoConfig

        return (AutoConfig.from_pretrained(folder).architectures or [None])[0]
    except Exception:  # offline or unknown: vLLM reports it
        return None


def server_command(args: argparse.Namespace, python: str) -> list[str]:
    """The vLLM server command line for parsed ``serve`` arguments (settings checked, model resolved)."""
    from vtprune.vllm.export import model_folder

    try:
        settings = VllmPruning.from_dict({"method": args.method, "keep": args.keep, "seed": args.seed})
        folder = model_folder(args.model)
        stock = architecture_of(folder)
        overrides: dict = {"vtprune": {"method": settings.method, "keep": settings.keep, "seed": settings.seed}}
        if stock is not None:
            overrides["architectures"] = [check_architecture(stock)]
    except ValueError as error:
        raise UserError(str(error).removeprefix("vtprune: ")) from None
    if "architectures" not in overrides:
        raise UserError(f"cannot read the architecture of {args.model!r}; serve a local folder, or start vLLM with "
                        "--hf-overrides '{\"architectures\": [\"VtpruneLlavaForConditionalGeneration\"], "
                        "\"vtprune\": {...}}' (docs/serving.md).")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--hf-overrides", json.dumps(overrides), "--host", args.host, "--port", str(args.port),
            *embedded_defaults(args.model, args.passthrough), *method_defaults(settings.method, stock, args.passthrough),
            *args.passthrough]


def method_defaults(method: str, architecture: str | None, given: list[str]) -> list[str]:
    """vLLM options a method needs, unless the user gave them: an images-only method on a video family serves
    images only."""
    if method not in IMAGE_METHODS or not str(architecture).removeprefix("Vtprune").startswith("Qwen"):
        return []
    if any(arg == "--limit-mm-per-prompt" or arg.startswith("--limit-mm-per-prompt=") for arg in given):
        return []
    return ["--limit-mm-per-prompt", json.dumps({"image": 4, "video": 0})]


def embedded_defaults(model: str, given: list[str]) -> list[str]:
    """vLLM options for the tiny embedded models (float32 as trained, eager, their 512-token context), unless
    the user gave them."""
    if not model.startswith("embedded:"):
        return []
    defaults = {"--dtype": "float32", "--max-model-len": "512", "--enforce-eager": None}
    out: list[str] = []
    for option, value in defaults.items():
        if not any(arg == option or arg.startswith(option + "=") for arg in given):
            out += [option] if value is None else [option, value]
    return out


def command_serve(args: argparse.Namespace) -> int:
    command = server_command(args, sys.executable if args.dry_run else vllm_python())
    if args.dry_run:
        print(" ".join(command))
        return 0
    print(f"vtprune: serving {args.model} with {args.method} keep {args.keep} on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU (ignored on a GPU)
    return subprocess.call(command, env=env)
