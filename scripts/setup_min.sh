#!/usr/bin/env bash
# Create .venv-min: the lowest transformers that pyproject.toml allows (5.19.0, what vLLM 0.32 pins), for the core contract tests.
# torch is the build setup.sh installs (the CPU build where nvidia-smi finds no GPU). Idempotent (a stamp skips the
# install when nothing changed); about 90 s the first time. A failed pip install stops the script (exit status 1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MIN_TRANSFORMERS=5.19.0
source scripts/setup_common.sh
if [ ! -x .venv-min/bin/python ]; then
  echo "[setup-min] creating .venv-min (transformers $MIN_TRANSFORMERS)"
  "$PYTHON" -m venv .venv-min
fi
stamp=$(cat constraints.txt pyproject.toml scripts/setup_min.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv-min/.vtprune-stamp 2>/dev/null)" != "$stamp" ]; then
  grep -v '^transformers' constraints.txt > .venv-min/constraints.txt
  echo "transformers==$MIN_TRANSFORMERS" >> .venv-min/constraints.txt
  install_torch .venv-min .venv-min/constraints.txt
  PIP=(.venv-min/bin/pip install -q --disable-pip-version-check --no-compile -c .venv-min/constraints.txt)
  pipq "${PIP[@]}" torch transformers "accelerate==1.15.0" safetensors tokenizers numpy pillow tqdm pytest \
    pytest-timeout "pytest-xdist==3.8.0" hypothesis
  pip_editable "${PIP[@]}"
  .venv-min/bin/python -c "import vtprune, transformers; assert transformers.__version__ == '$MIN_TRANSFORMERS'" \
    || { echo "[setup-min] the install is broken" >&2; exit 1; }
  echo "$stamp" > .venv-min/.vtprune-stamp
fi
echo "[setup-min] .venv-min ready: transformers $(.venv-min/bin/python -c 'import transformers; print(transformers.__version__)')"
