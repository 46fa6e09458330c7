#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (about 5-8 minutes on one H100/H200):
# kernel speed vs the torch twins, and prefill speedups at 7B-like LM geometry with random weights.
# Results land in docs/results/gpu/ (CSV + Markdown + PNG) with their conditions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
OUT=docs/results/gpu
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
.venv/bin/python -m vtprune.eval.bench_kernels --device cuda --out "$OUT/kernels"
.venv/bin/python -m vtprune.eval.plot_kernels --out "$OUT/kernels"
# LLaVA-1.5-7B-like LM (hidden 4096, 32 layers), bf16, SDPA, batch 1, 576 and 2916 visual tokens.
.venv/bin/vtprune bench --speed --device cuda --dtype bfloat16 --attn sdpa --speed-hidden 4096 --speed-layers 32 \
  --methods fastv,pdrop --keep 0.5,0.25,0.11 --repeats 10 --out "$OUT/speed-llava7b"
# Qwen2.5-VL-7B-like depth (hidden 3584, 28 layers).
.venv/bin/vtprune bench --speed --device cuda --dtype bfloat16 --attn sdpa --speed-hidden 3584 --speed-layers 28 \
  --methods fastv,pdrop --keep 0.5,0.25,0.11 --repeats 10 --out "$OUT/speed-qwen7b"
