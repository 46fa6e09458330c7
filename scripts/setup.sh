#!/usr/bin/env bash
# Create .venv in the checkout and install vtprune with the tested, pinned dependency set; torch is the CPU build
# when nvidia-smi finds no GPU (PyTorch's CPU index, with a fallback to the default index), else the CUDA build.
#   bash scripts/setup.sh run   the light set for running: vtprune + torch, transformers, matplotlib (quickstart.sh)
#   bash scripts/setup.sh dev   everything the tests, demo, benchmarks and lmms-eval need (test.sh; the default)
# Idempotent: a stamp of the requirement files skips the install when nothing changed; dev includes run.
# A failed pip install stops the script (exit status 1) and no stamp is written.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-dev}
case "$PROFILE" in run|dev) ;; *) echo "[setup] unknown profile '$PROFILE'; use run or dev" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
source scripts/setup_common.sh
PIP=(.venv/bin/pip install -q --disable-pip-version-check --no-compile -c constraints.txt)

dev_stamp=$(cat constraints.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
run_stamp=$(cat constraints.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat .venv/.vtprune-stamp 2>/dev/null)" = "$dev_stamp" ]; then
  :  # the development set is installed and current: it holds the run set too
elif [ "$PROFILE" = run ]; then
  if [ "$(cat .venv/.vtprune-stamp-run 2>/dev/null)" != "$run_stamp" ]; then
    echo "[setup] installing the run set: vtprune, torch, transformers, matplotlib (about 1.3 GB, a few minutes)"
    install_torch .venv constraints.txt
    pipq "${PIP[@]}" -e . matplotlib
    .venv/bin/python -c "import vtprune, torch, transformers" \
      || { echo "[setup] the install is broken: 'import vtprune' failed" >&2; exit 1; }
    echo "$run_stamp" > .venv/.vtprune-stamp-run
  fi
else
  echo "[setup] installing the development set (tests, demo, benchmarks, lmms-eval; several GB, a few minutes)"
  install_torch .venv constraints.txt
  pipq "${PIP[@]}" -r requirements-dev.txt
  # lmms-eval pulls torchvision from PyPI, built for the CUDA torch: beside a CPU torch it cannot import and
  # breaks transformers' image processors (see README, "Install"). A CUDA torch keeps its matching torchvision.
  if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    .venv/bin/pip uninstall -q -y torchvision 2>/dev/null || true
  fi
  pip_editable "${PIP[@]}"
  .venv/bin/python -c "import vtprune, torch, transformers" \
    || { echo "[setup] the install is broken: 'import vtprune' failed" >&2; exit 1; }
  echo "$dev_stamp" > .venv/.vtprune-stamp
  echo "$run_stamp" > .venv/.vtprune-stamp-run
fi
echo "[setup] .venv ready ($PROFILE): $(.venv/bin/python -c 'import torch, transformers, vtprune; print("vtprune", vtprune.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
