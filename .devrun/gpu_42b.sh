#!/usr/bin/env bash
# Issue 42b (1 GPU, <= 120 s with the op build): random-LTD vs dense training of the same GPT (24 layers, d 1024,
# seq 2048, bf16, Adam, interleaved steps; benchmarks/random_ltd_train.py). The kept length ramps 512 -> 2048 in
# steps of 256 over the first 80% of the 60 steps (the ramp sized to the run, as DeepSpeed's recipe ramps over
# most of training), full length after. Three runs, headline first:
#   1. SDPA flash for both systems (no per-shape cuDNN plan), micro-batch 8
#   2. torch's own SDPA pick (cuDNN on sm_90), micro-batch 4: tonight's earlier configuration
#   3. SDPA flash, micro-batch 4
# Each prints: the correctness line (kept tokens = bare block, sampler = torch.multinomial, eval-loss bar 1%),
# a table of ms/step per phase (dense, random-LTD, ratio; the bar is the "all timed" row), and one profiled
# active step per system: device-busy ms against wall ms and host syncs (busy << wall: host-bound).
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
START=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "from op_builder.random_ltd import RandomLTDCUDABuilder as C; C().load()" 2>&1 | tail -2
echo "op build $((SECONDS - START)) s"
run() {  # $1: max seconds; the rest: benchmark arguments. Stops at 118 s of the script in all.
    local left=$((118 - (SECONDS - START)))
    local limit=$(( $1 < left ? $1 : left ))
    if [ "$limit" -lt 15 ]; then echo "skipped (time): $*"; return; fi
    timeout "$limit" python3 benchmarks/random_ltd_train.py --steps 60 --warmup 5 --seq_per_step 256 "${@:2}" 2>&1 \
        | grep -vE "INFO|Warning|warn\(|_warn_once|warnings.warn|^\s*$|gpuGetDeviceCount" | tail -9
    echo "(run took $((SECONDS - START)) s since start; rc ${PIPESTATUS[0]})"
}
run 45 --sdpa flash --micro 8
run 35 --sdpa auto --micro 4
run 35 --sdpa flash --micro 4
