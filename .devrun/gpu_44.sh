#!/usr/bin/env bash
# needs 1 GPU. Issue 44 (compression / MoQ): fused fake-quant CUDA kernel bit-equal to the C kernel and to the torch
# reference (fp32/fp16/bf16, sym/asym, groups, stochastic), then its bandwidth at 2^28 fp32 elements vs copy_ (bar
# >= 0.85 of copy) and vs DeepSpeed 0.19.6's torch quantizer arithmetic. ~60 s incl. the op build.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 100 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning"
