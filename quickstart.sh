#!/usr/bin/env bash
# Quick start: set up .venv, then answer a few questions with the embedded model, unpruned and pruned.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
.venv/bin/vtprune info
.venv/bin/vtprune demo-run
