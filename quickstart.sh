#!/usr/bin/env bash
# Quick start: set up .venv (the light run set; torch is the CPU build without a GPU, the CUDA build with one),
# then run the embedded model on generated questions, unpruned and pruned. ./test.sh later upgrades .venv to
# the full development set.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh run
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
cat <<'EOF'

The embedded model used below is a 2 M-parameter LLaVA shipped in the package: it answers one-word questions
about generated images of coloured shapes (16 visual tokens per image), nothing else. Real checkpoints:
README, "Use it from Python".

== one question about a generated vtprune-shapes image, FastV keeping 25% of the visual tokens
EOF
.venv/bin/vtprune run --method fastv --keep 0.25 --sample 3
echo; echo "== 10 images x 6 questions: accuracy and evidence recall per method (embedded model, CPU; about 1 min)"
mkdir -p runs/quickstart
.venv/bin/vtprune bench --images 10 --methods none,random,oracle,fastv,pdrop --keep 1,0.25 \
  --timing-samples 2 --repeats 2 --out runs/quickstart --force > runs/quickstart/bench.log 2>&1 \
  || { cat runs/quickstart/bench.log >&2; exit 1; }
.venv/bin/python - <<'EOF'
import csv

rows = [r for r in csv.DictReader(open("runs/quickstart/bench.csv")) if r["qtype"] == "all"]
print("| method | keep | visual tokens kept | accuracy | evidence recall | LM prefill FLOPs vs unpruned |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['method']} | {float(r['keep']):g} | {float(r['mean_kept']):.0f} of 16 | {float(r['accuracy']):.3f} "
          f"| {float(r['evidence_recall']):.2f} | {float(r['flops_ratio']):.2f} |")
EOF
cat <<'EOF'

How to read it: `none` is the unpruned model; `random` and `oracle` (keeps the tokens that hold the answer) are
the floor and the ceiling; fastv and pdrop are two pruning methods. Evidence recall is the share of the answer
object's visual tokens still kept. 10 images are a small sample: the 100-image run is in
docs/results/embedded-llava. Times are not shown here: on a model this small the fixed costs dominate and a
pruned prefill is no faster; speed at 576-2,880 visual tokens is `vtprune bench --speed`
(docs/results/speed-proxy). The full report, per question type, with timings: runs/quickstart/bench.md.

== next steps
Activate the environment so that `vtprune` and `python -m vtprune` work in your shell:
  source .venv/bin/activate
  vtprune info                                      # versions, model types, methods
  vtprune sample --image shapes.png                 # an image the embedded model can answer about
  vtprune run --image shapes.png --question "What color is the circle?" --method pdrop --keep 0.25
For a real model on a GPU see docs/use_on_your_model.md.
EOF
