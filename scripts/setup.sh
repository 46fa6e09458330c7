#!/usr/bin/env bash
# Create .venv in the checkout and install vtprune with the tested, pinned dependency set (CPU torch).
# Idempotent: a stamp of the requirement files skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
stamp=$(cat constraints.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat .venv/.vtprune-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "[setup] installing dependencies (torch pinned by constraints.txt; a few minutes the first time)"
  .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -r requirements-dev.txt 2>&1 \
    | grep -v "WARNING: Location" || true
  # lmms-eval pulls torchvision, which cannot import beside the CPU torch build and breaks image processors.
  .venv/bin/pip uninstall -q -y torchvision 2>/dev/null || true
  .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt --no-deps -e . 2>&1 \
    | grep -v "WARNING: Location" || true
  .venv/bin/python -c "import vtprune, torch, transformers" \
    || { echo "[setup] the install is broken: 'import vtprune' failed" >&2; exit 1; }
  echo "$stamp" > .venv/.vtprune-stamp
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch, transformers, vtprune; print("vtprune", vtprune.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
