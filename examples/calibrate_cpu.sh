#!/usr/bin/env bash
# Calibrate on this machine's CPU: real FSDP2 training steps under torchrun (2 ranks, gloo), then a fit.
# Run from the repository root (the factory module tests/distributed/calib_models.py is imported from it).
# About 90 s on 2 cores. On a GPU cluster drop --device cpu and the factory: see docs/calibration.md.
set -euo pipefail
OUT=${1:-calib-cpu}
MODEL=(--factory tests.distributed.calib_models:small_llama --seq-len 128 --global-batch 8)
RUN=(--gpus 2 --device cpu --steps 5 --warmup 2 --timeout 120)

# 1. plan, run the 3 best candidates, fit OUT/profile.json, re-rank by measured throughput
fsdp-plan calibrate "${MODEL[@]}" "${RUN[@]}" --top 3 --out "$OUT"

# 2. add a run of another shape (4 micro-steps of 1 sequence) to the same calibration and refit from all
#    four: --resume keeps what OUT/results.jsonl holds and runs only what is new
fsdp-plan calibrate "${MODEL[@]}" "${RUN[@]}" --sharding FULL_SHARD --micro-batch 1 --out "$OUT" --resume

# 3. predict a configuration none of them ran with the fitted profile, then measure it (no refit)
fsdp-plan calibrate "${MODEL[@]}" "${RUN[@]}" --profile "$OUT/profile.json" --no-fit \
    --sharding FULL_SHARD --micro-batch 4 --activation-checkpointing every-2 --out "$OUT-check"
