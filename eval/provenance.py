"""Provenance of a results file: which weights ran, and which code (git SHA, and whether the tree was dirty).

The git SHA alone can predate the weights (a model retrained and not yet committed), so every results
file also records a fingerprint of the weights it ran.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import torch
from torch import nn

SAMPLES_PER_TENSOR = 4096
REPO_ROOT = Path(__file__).resolve().parent.parent


def weights_fingerprint(model: nn.Module, full: bool = False) -> str:
    """A 16-hex-digit fingerprint of ``model``'s parameters and buffers.

    Every tensor contributes its name, shape and dtype, plus its values: all of them with ``full=True``,
    otherwise ``SAMPLES_PER_TENSOR`` evenly strided elements (a 7B model fingerprints in about a second;
    any retraining changes the sampled values). Tensors on ``meta`` (offloaded) contribute shape only.
    """
    digest = hashlib.sha256()
    for name, tensor in _named_tensors(model):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        flat = tensor.detach().reshape(-1)
        if not full and flat.numel() > SAMPLES_PER_TENSOR:
            step = flat.numel() // SAMPLES_PER_TENSOR
            flat = flat[:: step][:SAMPLES_PER_TENSOR]
        digest.update(flat.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _named_tensors(model: nn.Module):
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


def git_state(root: Path = REPO_ROOT) -> dict[str, str | bool]:
    """``{"git_sha": short SHA or "unknown", "git_dirty": True when tracked files differ from HEAD}``."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return {"git_sha": "unknown", "git_dirty": False}
    return {"git_sha": sha or "unknown", "git_dirty": bool(status.strip())}
