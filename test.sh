#!/usr/bin/env bash
# Set up .venv (and the Debian packages the browser/video tests use), then run the whole test suite.
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
exit "$status"
