"""``vtprune serve``: vLLM's OpenAI-compatible server with vtprune's plugin (pre-LLM and layer-wise pruning), one command.

``vtprune serve [MODEL] --method divprune --keep 0.25 [vLLM options]`` checks the settings here (one line,
exit 2), turns ``embedded:llava`` / ``embedded:qwen2_vl`` into a folder vLLM loads, and runs
``python -m vllm.entrypoints.openai.api_server`` in the Python that has vLLM: this one, ``$VTPRUNE_VLLM_PYTHON``,
or the venv ``scripts/setup_vllm.sh`` makes. Options it does not know go to vLLM unchanged. No vLLM import here.

The port is checked (a TCP port, free on ``--host``) before vLLM starts. The server runs as a child in its own
process group: SIGTERM / SIGINT (Ctrl-C) to ``vtprune serve`` are forwarded to it and ``vtprune serve`` waits
until it has exited (``SIGKILL`` to its whole process group, vLLM's EngineCore and workers included, after
:data:`GRACE_S` seconds), so stopping ``vtprune serve`` frees the port and the engine's memory;
on Linux the child is also terminated if ``vtprune serve`` dies without a chance to forward anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from vtprune.cli.checks import check_port, int_range
from vtprune.errors import UserError
from vtprune.vllm.middleware import server_options
from vtprune.vllm.settings import IMAGE_METHODS, VllmPruning, check_architecture

DEFAULT_MODEL = "embedded:llava"
EPILOG = """\
examples:
  vtprune serve                                          the embedded LLaVA, divprune keep 0.25, port 8000
  vtprune serve embedded:qwen2_vl --keep 0.5 --trust-request-mm-kwargs    clients may send vtprune_keep
  vtprune serve --method fastv --keep 0.25               FastV inside the language model (prunes before layer 2)
  vtprune serve llava-hf/llava-1.5-7b-hf --dtype float16 --tensor-parallel-size 8     vLLM options pass through
needs vLLM: pip install -e ".[vllm]" (GPU, in the clone) or bash scripts/setup_vllm.sh (CPU); see
docs/serving.md."""
VENV_PYTHON = Path.home() / ".cache" / "vtprune" / "venv-vllm-0.32.0" / "bin" / "python"
GRACE_S = 30.0  # seconds the server has to exit after a forwarded signal, then SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="start vLLM's OpenAI-compatible server with visual-token pruning",
                                  epilog=EPILOG)
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help="embedded:llava, embedded:qwen2_vl, a model folder or a Hub id (LLaVA-1.5, LLaVA-NeXT, "
                            "LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    serve.add_argument("--method", default="divprune", help="before the language model: divprune, random, temporal "
                       "(Qwen2-VL / Qwen2.5-VL video), visionzip (LLaVA-1.5, Qwen-VL) or vflowopt (the same families, "
                       "images; its pre-LLM stage); inside it: fastv, pdrop, transprune, ttv, dart, and fastv+debias, "
                       "pdrop+debias, transprune+debias; prefixkv (each layer keeps its own KV entries; "
                       "docs/serving.md)")
    serve.add_argument("--keep", type=float, default=0.25, help="fraction of each image's visual tokens kept, in (0, 1]")
    serve.add_argument("--seed", type=int_range(0), default=0, help="seed of --method random")
    serve.add_argument("--layer", type=int_range(1), default=None,
                       help="layer-wise methods: the first decoder layer that sees the pruned tokens (one stage there; "
                            "FastV's K, default 2); by default each method's own schedule")
    serve.add_argument("--host", default="127.0.0.1", help="address the server listens on")
    serve.add_argument("--port", type=int_range(1, 65535), default=8000, help="port the server listens on, 1..65535")
    serve.add_argument("--dry-run", action="store_true",
                       help="print the vLLM command line, quoted for a POSIX shell (ready to paste), and exit")
    serve.set_defaults(func=command_serve, passthrough=[])


def has_vllm() -> bool:
    """Whether this Python can import vLLM (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_python() -> str:
    """A Python that imports vLLM, or a one-line :class:`UserError` naming the install."""
    given = os.environ.get("VTPRUNE_VLLM_PYTHON")
    if given:
        if not os.access(given, os.X_OK) or Path(given).is_dir():
            raise UserError(f"VTPRUNE_VLLM_PYTHON={given!r} is not an executable Python; point it at the python of "
                            "a venv that has vLLM, or unset it.")
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
        raw = {"method": args.method, "keep": args.keep, "seed": args.seed}
        if args.layer is not None:
            raw["layer"] = args.layer
        settings = VllmPruning.from_dict(raw)
        folder = model_folder(args.model)
        stock = architecture_of(folder)
        overrides: dict = {"vtprune": {key: value for key, value in raw.items()}}
        if stock is not None:
            overrides["architectures"] = [check_architecture(stock)]
            check_model(settings, folder, overrides["architectures"][0])
    except ValueError as error:
        raise UserError(str(error).removeprefix("vtprune: ")) from None
    if "architectures" not in overrides:
        raise UserError(f"cannot read the architecture of {args.model!r}; serve a local folder, or start vLLM with "
                        "--hf-overrides '{\"architectures\": [\"VtpruneLlavaForConditionalGeneration\"], "
                        "\"vtprune\": {...}}' (docs/serving.md).")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--hf-overrides", json.dumps(overrides), "--host", args.host, "--port", str(args.port),
            *embedded_defaults(args.model, args.passthrough), *method_defaults(settings.method, stock, args.passthrough),
            *server_options(args.passthrough), *args.passthrough]


#: The families whose videos arrive as equal frames that ``temporal`` ranks (``frame_videos`` of their vLLM
#: processors, :mod:`vtprune.vllm.qwen`), and those that recompute the tower attention the tower methods read.
FRAME_VIDEO_FAMILIES = ("VtpruneQwen2VLForConditionalGeneration", "VtpruneQwen2_5_VLForConditionalGeneration")
TOWER_FAMILY_NAMES = ("VtpruneLlavaForConditionalGeneration", *FRAME_VIDEO_FAMILIES,
                      "VtpruneQwen3VLForConditionalGeneration")


def check_model(settings: VllmPruning, folder: str, architecture: str) -> None:
    """Refuse (one-line ``ValueError``) settings the served model cannot run, before vLLM spends a minute
    starting: ``temporal`` on a family without frame videos, a tower method on a family whose tower the plugin
    does not recompute, and a layer-wise method's stages against the model's depth, with the plan the plugin
    makes at start-up (:func:`vtprune.vllm.layerwise.plan.make_layer_plan`: ``validate_stages``, as vtprune's
    transformers path checks ``--layer``). ``architecture``: the pruned name."""
    from vtprune.vllm.settings import TOWER_FAMILIES, TOWER_METHODS, is_retention

    family = architecture.removeprefix("Vtprune")
    if settings.method == "temporal" and architecture not in FRAME_VIDEO_FAMILIES:
        raise ValueError(f"vtprune: method 'temporal' prunes tokens repeated across video frames, which the plugin "
                         f"does for Qwen2-VL / Qwen2.5-VL video only, not {family}; serve 'divprune' or 'random'.")
    if settings.method in TOWER_METHODS and architecture not in TOWER_FAMILY_NAMES:
        raise ValueError(f"vtprune: method {settings.method!r} reads the vision tower's attention, which the plugin "
                         f"recomputes for {TOWER_FAMILIES[settings.method]} only, not {family}; serve 'divprune'.")
    if not settings.layer_wise or is_retention(settings.method):
        return
    config = _model_config(folder)
    if config is None:  # unreadable here: vLLM reads it and the plugin checks the plan at start-up
        return
    from vtprune.vllm.layerwise.config import deepstack_layers
    from vtprune.vllm.layerwise.plan import make_layer_plan

    text = config.get_text_config()
    try:
        make_layer_plan(settings.method, settings.keep, int(text.num_hidden_layers), options=dict(settings.options),
                        layer=settings.layer, min_layer=max(1, deepstack_layers(config)),
                        model_type=str(getattr(config, "model_type", "model")), hf_config=config)
    except ValueError as error:
        flag = f"--layer {settings.layer}" if settings.layer is not None else f"--method {settings.method}"
        raise ValueError(f"{flag}: {str(error).removeprefix('vtprune: ')}") from None


def _model_config(folder: str):
    """The transformers config of a model folder (or cached Hub id), None if it cannot be read here."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)
    except Exception:  # noqa: BLE001 (offline, a partial config: vLLM reports it)
        return None


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
    if args.dry_run:
        print(dry_run_line(server_command(args, _dry_run_python()), server_env(os.environ)))
        return 0
    check_port(args.host, args.port)  # before vLLM spends minutes starting, only to find the port taken
    command = server_command(args, vllm_python())
    print(f"vtprune: serving {args.model} with {args.method} keep {args.keep} on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    return run_server(command, {**os.environ, **server_env(os.environ)})


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables ``vtprune serve`` adds for vLLM (those ``environ`` does not set already)."""
    # GiB of KV cache on a CPU (ignored on a GPU); vLLM's V1 model runner, whose seams the plugin uses (a GPU with
    # Triton would pick the V2 runner; the layer-wise methods refuse it at start-up)
    defaults = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    return {name: value for name, value in defaults.items() if name not in environ}


def dry_run_line(command: list[str], env: Mapping[str, str]) -> str:
    """``command`` as one line a POSIX shell runs as is: ``NAME=value`` assignments for ``env`` first, every
    word quoted where the shell would split or expand it (the JSON of ``--hf-overrides``, paths with spaces)."""
    return shlex.join([f"{name}={value}" for name, value in env.items()] + list(command))


def _dry_run_python() -> str:
    """The Python the server would run in; this one when none with vLLM is found (a dry run needs no vLLM)."""
    try:
        return vllm_python()
    except UserError:
        return sys.executable


def run_server(command: list[str], env: dict[str, str] | None = None, grace_s: float = GRACE_S) -> int:
    """Run the server ``command`` as a child, forwarding SIGTERM / SIGINT to it; its exit status.

    After a forwarded signal the child has ``grace_s`` seconds to exit before it is killed; either way this
    returns only once the child is gone (128 + the signal's number after a signal, as a shell reports it).
    """
    received: list[tuple[int, float]] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        received.append((signum, time.monotonic()))
        if started and started[0].poll() is None:
            started[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        started.append(child)
        if received:  # a signal came while the child was starting
            child.send_signal(received[0][0])
        while child.poll() is None:
            try:
                child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if received and time.monotonic() - received[0][1] > grace_s and child.poll() is None:
                    print(f"vtprune: the server did not exit within {grace_s:g} s of the signal; killing it and "
                          "its engine processes", file=sys.stderr, flush=True)
                    _kill_group(child.pid)
                    child.wait()
        if received:  # the server is gone: what it started must not outlive the grace either
            _end_group(child.pid, received[0][1] + grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0][0]
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


def _kill_group(group: int) -> None:
    """SIGKILL every process of the server's process group (its id is the server's pid: ``start_new_session``),
    vLLM's EngineCore and workers included, not the API server alone."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _end_group(group: int, deadline: float) -> None:
    """Wait until ``deadline`` (``time.monotonic()``) for the rest of the server's process group to exit, then
    kill what is left of it."""
    while _group_alive(group) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(group):
        _kill_group(group)


def _group_alive(group: int) -> bool:
    """Does any process of ``group`` still exist (zombies awaiting their reaper included)?"""
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _die_with_parent() -> None:
    """In the child, before exec (Linux): get SIGTERM when ``vtprune serve`` dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
