#!/usr/bin/env bash
# Quick start: set up .venv (the light run set), then run the embedded model on generated questions,
# unpruned and pruned. ./test.sh later upgrades .venv to the full development set.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh run
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
echo; echo "== one question about a generated vtprune-shapes image, FastV keeping 25% of the visual tokens"
.venv/bin/vtprune run --method fastv --keep 0.25 --sample 3
echo; echo "== 10 images x 6 questions: accuracy, evidence recall and cost per method (embedded model, CPU)"
.venv/bin/vtprune bench --images 10 --methods none,random,oracle,fastv,pdrop --keep 1,0.25 \
  --timing-samples 2 --repeats 2 --out runs/quickstart
cat <<'EOF'

== next steps
Activate the environment so that `vtprune` and `python -m vtprune` work in your shell:
  source .venv/bin/activate
  vtprune info                                      # versions, model types, methods
  vtprune sample --image shapes.png                 # an image the embedded model can answer about
  vtprune run --image shapes.png --question "What color is the circle?" --method pdrop --keep 0.25
The embedded model knows only the vtprune-shapes task (coloured shapes; see README, "The embedded models").
For a real model on a GPU see docs/use_on_your_model.md.
EOF
