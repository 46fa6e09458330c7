#!/usr/bin/env bash
# Regenerate docs/results/speed-proxy (CSV, speed.md, PNGs): vtprune bench --speed on the CPU speed proxies.
#
#   scripts/refresh_speed.sh full      # every geometry (576, 2880, 2304, 16384, video), LM 1024 x 16, batch 1 and 8,
#                                      # fastv, pdrop and prefixkv at keep 1/0.5/0.25/0.11, 32 new tokens, 5 repeats
#                                      # (many hours on 2 shared cores; run it on a quiet machine)
#   scripts/refresh_speed.sh reduced   # what is committed now: 576 and 2880, LM 512 x 8 (about an hour)
#
# One torch thread: on the shared 2-core machine two OpenMP threads stall each other whenever anything else runs
# (the same 576-token generate took 9.2 s with 2 threads and 1.0 s with 1). Splits run one after the other and are
# merged with `vtprune bench speed-report --merge`.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
OUT=docs/results/speed-proxy
RUNS=runs/speed-proxy
mode=${1:-reduced}
bench() { .venv/bin/vtprune bench --speed --speed-new-tokens 32 --repeats 5 --threads 1 --force "$@"; }
ALL=(--methods fastv,pdrop,prefixkv)  # prefixkv: KV-cache retention (decode time, KV bytes)
mkdir -p "$RUNS"
case "$mode" in
  full)
    bench "${ALL[@]}" --keep 1,0.5,0.25,0.11 --speed-tokens all --speed-batches 1,8 --out "$RUNS/full"
    .venv/bin/python -m vtprune bench speed-report "$OUT" --force --merge "$RUNS/full/speed.csv"
    ;;
  reduced)
    LM=(--speed-hidden 512 --speed-layers 8)
    bench "${LM[@]}" "${ALL[@]}" --keep 1,0.5,0.25,0.11 --speed-tokens 576 --speed-batches 1,8 --out "$RUNS/576"
    bench "${LM[@]}" "${ALL[@]}" --keep 1,0.5,0.25,0.11 --speed-tokens 2880 --speed-batches 1 --out "$RUNS/2880-b1"
    bench "${LM[@]}" --methods fastv,pdrop --keep 1,0.25 --speed-tokens 2880 --speed-batches 8 --out "$RUNS/2880-b8"
    .venv/bin/python -m vtprune bench speed-report "$OUT" --force \
      --merge "$RUNS/576/speed.csv" "$RUNS/2880-b1/speed.csv" "$RUNS/2880-b8/speed.csv"
    ;;
  *) echo "usage: scripts/refresh_speed.sh [full|reduced]" >&2; exit 2 ;;
esac
echo "[refresh_speed] $OUT/speed.md"
