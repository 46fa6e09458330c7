# Sourced by scripts/setup.sh, scripts/setup_min.sh and scripts/setup_vllm.sh (not run on its own).
#   pipq CMD...       run a pip command without the "WARNING: Location ... is ignored" lines; pip's own exit status
#   pip_editable PIP...   PIP --no-deps -e . under a lock: test.sh runs the setup scripts at the same time, and
#                         each editable build writes vtprune.egg-info in this checkout
#   install_torch VENV CONSTRAINTS   install torch into VENV with the build this machine needs, pinned by the
#                                    CONSTRAINTS file: PyPI's Linux wheels are CUDA builds (several GB; they run on a
#                                    CPU too), so without a GPU take the CPU build from PyTorch's CPU index (with a
#                                    fallback to the default index). VTPRUNE_TORCH=cpu|cuda overrides the choice.
# Installs skip byte-compiling (--no-compile): Python compiles the modules a program imports on first use, and
# compiling every file of torch, transformers and the rest at install time costs minutes of CPU.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

pipq() {
  "$@" 2>&1 | { grep -v "WARNING: Location" || true; }
  return "${PIPESTATUS[0]}"
}

pip_editable() {
  local lock="${TMPDIR:-/tmp}/vtprune-editable-$(pwd | sha256sum | cut -c1-12).lock"
  if command -v flock >/dev/null 2>&1; then
    pipq flock "$lock" "$@" --no-deps -e .
  else
    pipq "$@" --no-deps -e .
  fi
}

# "torch 2.13.0+cpu (CPU build)" / "torch 2.13.0+cu128 (CUDA 12.8 build)" (numpy may not be installed yet: quiet)
torch_build() {
  "$1/bin/python" -W ignore -c 'import torch; c = torch.version.cuda; print(f"torch {torch.__version__} " + (f"(CUDA {c} build)" if c else "(CPU build)"))' 2>/dev/null
}

install_torch() {
  local venv=$1 constraints=$2
  local pip=("$venv/bin/pip" install -q --disable-pip-version-check --no-compile -c "$constraints")
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] torch already installed in $venv: $(torch_build "$venv")"
    return 0
  fi
  local want=${VTPRUNE_TORCH:-}
  if [ -z "$want" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then want=cuda; else want=cpu; fi
  fi
  if [ "$want" = cuda ]; then
    echo "[setup] a GPU answered nvidia-smi: installing the CUDA build of torch from the default index (several GB)"
    pipq "${pip[@]}" torch || true
  elif "$venv/bin/python" -c "import urllib.request; urllib.request.urlopen('$TORCH_CPU_INDEX/torch/', timeout=8)" 2>/dev/null; then
    echo "[setup] no GPU found (nvidia-smi): installing the CPU build of torch from $TORCH_CPU_INDEX (about 200 MB)"
    pipq "${pip[@]}" --index-url "$TORCH_CPU_INDEX" torch || true
  else
    echo "[setup] no GPU found (nvidia-smi), but PyTorch's CPU index ($TORCH_CPU_INDEX) is not reachable: installing"
    echo "[setup]   torch from the default index with $constraints instead (on Linux that is PyPI's CUDA build,"
    echo "[setup]   several GB, which runs on a CPU too, unless your pip configuration provides a CPU wheel)"
    pipq "${pip[@]}" torch || true
  fi
  "$venv/bin/python" -W ignore -c "import torch" 2>/dev/null \
    || { echo "[setup] torch did not install; install it by hand (see README, Install) and rerun" >&2; return 1; }
  echo "[setup] installed $(torch_build "$venv") in $venv"
}
