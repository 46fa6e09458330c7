#!/usr/bin/env bash
# Recompute everything under docs/results/ and the calibration files of the embedded models (CPU, ~30 min).
# Run after training new embedded models (python -m vtprune.eval.train_tiny ...); see docs/results/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
V=.venv/bin/vtprune
LLAVA=vtprune/models/vtprune-llava-shapes
QWEN=vtprune/models/vtprune-qwen2vl-shapes
$V calibrate --model embedded:llava --method pdrop --out $LLAVA/calibration.json
$V calibrate --model embedded:qwen2_vl --method pdrop --out $QWEN/calibration.json
$V bench --images 100 --threads 2 \
  --methods none,random,oracle,fastv,fastv+debias,pdrop,pdrop+debias,transprune,ttv,vflowopt \
  --keep 1,0.5,0.33,0.25,0.11 --out docs/results/embedded-llava
$V bench --model embedded:qwen2_vl --images 100 --threads 2 \
  --methods none,random,oracle,fastv,fastv+debias,pdrop,pdrop+debias,transprune,ttv \
  --keep 1,0.5,0.25 --out docs/results/embedded-qwen2vl
$V bench --video --model embedded:qwen2_vl --clips 50 --threads 2 --answer score \
  --methods none,fastv,pdrop --keep 1,0.5,0.25 --out docs/results/embedded-qwen2vl-video
