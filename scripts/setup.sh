#!/usr/bin/env bash
# Create .venv in the checkout and install vtprune with the tested, pinned dependency set; torch is the CPU build
# when nvidia-smi finds no GPU (PyTorch's CPU index, with a fallback to the default index), else the CUDA build.
#   bash scripts/setup.sh run   the light set for running: vtprune + torch, transformers, matplotlib (quickstart.sh)
#   bash scripts/setup.sh dev   everything the tests, demo, benchmarks and lmms-eval need (test.sh; the default)
# Idempotent: a stamp of the requirement files skips the install when nothing changed; dev includes run.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-dev}
case "$PROFILE" in run|dev) ;; *) echo "[setup] unknown profile '$PROFILE'; use run or dev" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt)
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# torch first, the build this machine needs: PyPI's Linux wheels are CUDA builds (several GB; they run on a CPU
# too), so without a GPU take the CPU build from PyTorch's CPU index. VTPRUNE_TORCH=cpu|cuda overrides the choice.
install_torch() {
  if .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "[setup] torch already installed: $(torch_build)"
    return 0
  fi
  local want=${VTPRUNE_TORCH:-}
  if [ -z "$want" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then want=cuda; else want=cpu; fi
  fi
  if [ "$want" = cuda ]; then
    echo "[setup] a GPU answered nvidia-smi: installing the CUDA build of torch from the default index (several GB)"
    "${PIP[@]}" torch 2>&1 | grep -v "WARNING: Location" || true
  elif .venv/bin/python -c "import urllib.request; urllib.request.urlopen('$TORCH_CPU_INDEX/torch/', timeout=8)" 2>/dev/null; then
    echo "[setup] no GPU found (nvidia-smi): installing the CPU build of torch from $TORCH_CPU_INDEX (about 200 MB)"
    "${PIP[@]}" --index-url "$TORCH_CPU_INDEX" torch 2>&1 | grep -v "WARNING: Location" || true
  else
    echo "[setup] no GPU found (nvidia-smi), but PyTorch's CPU index ($TORCH_CPU_INDEX) is not reachable: installing"
    echo "[setup]   torch from the default index with constraints.txt instead (on Linux that is PyPI's CUDA build, several"
    echo "[setup]   GB, which runs on a CPU too, unless your pip configuration provides a CPU wheel)"
    "${PIP[@]}" torch 2>&1 | grep -v "WARNING: Location" || true
  fi
  .venv/bin/python -W ignore -c "import torch" 2>/dev/null \
    || { echo "[setup] torch did not install; install it by hand (see README, Install) and rerun" >&2; exit 1; }
  echo "[setup] installed $(torch_build)"
}

# "torch 2.13.0+cpu (CPU build)" / "torch 2.13.0+cu128 (CUDA 12.8 build)" (numpy may not be installed yet: quiet)
torch_build() {
  .venv/bin/python -W ignore -c 'import torch; c = torch.version.cuda; print(f"torch {torch.__version__} " + (f"(CUDA {c} build)" if c else "(CPU build)"))' 2>/dev/null
}
dev_stamp=$(cat constraints.txt requirements-dev.txt pyproject.toml | sha256sum | cut -c1-16)
run_stamp=$(cat constraints.txt pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat .venv/.vtprune-stamp 2>/dev/null)" = "$dev_stamp" ]; then
  :  # the development set is installed and current: it holds the run set too
elif [ "$PROFILE" = run ]; then
  if [ "$(cat .venv/.vtprune-stamp-run 2>/dev/null)" != "$run_stamp" ]; then
    echo "[setup] installing the run set: vtprune, torch, transformers, matplotlib (about 1.3 GB, a few minutes)"
    install_torch
    "${PIP[@]}" -e . matplotlib 2>&1 | grep -v "WARNING: Location" || true
    .venv/bin/python -c "import vtprune, torch, transformers" \
      || { echo "[setup] the install is broken: 'import vtprune' failed" >&2; exit 1; }
    echo "$run_stamp" > .venv/.vtprune-stamp-run
  fi
else
  echo "[setup] installing the development set (tests, demo, benchmarks, lmms-eval; several GB, a few minutes)"
  install_torch
  "${PIP[@]}" -r requirements-dev.txt 2>&1 | grep -v "WARNING: Location" || true
  # lmms-eval pulls torchvision from PyPI, built for the CUDA torch: beside a CPU torch it cannot import and
  # breaks transformers' image processors (see README, "Install"). A CUDA torch keeps its matching torchvision.
  if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    .venv/bin/pip uninstall -q -y torchvision 2>/dev/null || true
  fi
  "${PIP[@]}" --no-deps -e . 2>&1 | grep -v "WARNING: Location" || true
  .venv/bin/python -c "import vtprune, torch, transformers" \
    || { echo "[setup] the install is broken: 'import vtprune' failed" >&2; exit 1; }
  echo "$dev_stamp" > .venv/.vtprune-stamp
  echo "$run_stamp" > .venv/.vtprune-stamp-run
fi
echo "[setup] .venv ready ($PROFILE): $(.venv/bin/python -c 'import torch, transformers, vtprune; print("vtprune", vtprune.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
