#!/usr/bin/env bash
# Recompute the embedded-model results under docs/results/ and their calibration files (CPU, 1 thread: 20-25 min per embedded model on a loaded 2-core machine).
# speed-proxy and kernels have their own commands (docs/results/README.md).
# Run after training new embedded models (vtprune bench train ...); see docs/results/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
V=.venv/bin/vtprune
LLAVA=vtprune/models/vtprune-llava-shapes
QWEN=vtprune/models/vtprune-qwen2vl-shapes
$V calibrate --model embedded:llava --method pdrop --out $LLAVA/calibration.json --force
$V calibrate --model embedded:qwen2_vl --method pdrop --out $QWEN/calibration.json --force
$V bench --images 100 --threads 1 \
  --methods none,random,oracle,fastv,fastv+debias,pdrop,pdrop+debias,transprune,ttv,vflowopt,visionzip,divprune,dart,prefixkv,sparsevlm,vispruner,cdpruner,vscan,mmtok,hiprune,scope,idpruner \
  --keep 1,0.5,0.33,0.25,0.11 --out docs/results/embedded-llava --force
$V bench --model embedded:qwen2_vl --images 100 --threads 1 \
  --methods none,random,oracle,fastv,fastv+debias,pdrop,pdrop+debias,transprune,ttv,vflowopt,visionzip,divprune,dart,prefixkv,sparsevlm,vispruner,cdpruner,vscan,mmtok,hiprune,scope,idpruner \
  --keep 1,0.5,0.33,0.25,0.11 --out docs/results/embedded-qwen2vl --force
$V bench --model embedded:llava64 --images 100 --threads 1 \
  --methods none,random,oracle,fastv,fastv+debias,pdrop,pdrop+debias,transprune,ttv,vflowopt,visionzip,divprune,dart,prefixkv,sparsevlm,vispruner,cdpruner,vscan,mmtok,hiprune,scope,idpruner \
  --keep 1,0.5,0.25,0.1 --out docs/results/embedded-llava64 --force
$V bench --video --model embedded:qwen2_vl --clips 30 --threads 1 --open-ended --answer score \
  --methods none,fastv,pdrop,fastv@per_frame,pdrop@per_frame,temporal,temporal@fastv,sparsevlm,vispruner,cdpruner,vscan,mmtok,hiprune,scope,idpruner \
  --keep 1,0.5,0.25,0.11 --out docs/results/embedded-qwen2vl-video --force
