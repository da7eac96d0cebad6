#!/usr/bin/env bash
# needs 1 GPU, <= 100 s incl. the op build. CI/duplicates session 4: csrc/cuda/compress_quant.cu's range reduction and
# scale/zero-point code folded into shared device functions (D1). Checks the fused fake-quant CUDA kernel still
# bit-equal to the C kernel and the torch reference (84 cases), and its bandwidth vs copy_ unchanged (session 4's
# first call: sym8 g1 0.87, asym4 0.88, g=n/2^16 0.91, 4096/g 1pass 0.58, stochastic 0.82 of copy).
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 100 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning"
