#!/usr/bin/env bash
# Quick start: set up .venv, then run the embedded model on generated questions, unpruned and pruned.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
echo; echo "== one question, FastV keeping 25% of the visual tokens"
.venv/bin/vtprune run --method fastv --keep 0.25 --sample 3
echo; echo "== 10 images x 6 questions: accuracy, evidence recall and cost per method (embedded model, CPU)"
.venv/bin/vtprune bench --images 10 --methods none,random,oracle,fastv,pdrop --keep 1,0.25 \
  --timing-samples 2 --repeats 2 --out runs/quickstart
cat runs/quickstart/bench.md
echo "Plots: runs/quickstart/*.png"
