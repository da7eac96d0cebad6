#!/usr/bin/env bash
# needs 1 GPU, ~7 min. Session 8: (1) issue 44 fake-quant kernel variants (.devrun/qbench.cu), bit-equality then
# bandwidth vs copy; (2) issue 41 per-kernel profile of ours vs HF (2 layers, seq 128, bf16); (3) gpu_41d (DeepSpeed's
# transformer kernel in fp16 side by side, evoformer); (4) gpu_52d (SuperOffload after the host-worker fixes).
set -uo pipefail
export PYTHONUNBUFFERED=1
echo "== (1) qbench $(date +%T)"
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/qbench.cu -o /tmp/qb 2>&1 | grep -v "declared but never\|^$" | head -5
timeout 60 /tmp/qb 28
echo "== (2) transformer profile $(date +%T)"
timeout 60 python3 benchmarks/transformer_kernel.py --profile-only 2>&1 | grep -vE "^\s*$|UserWarning|warn" | head -80
echo "== (3) gpu_41d $(date +%T)"
bash .devrun/gpu_41d.sh
echo "== (4) gpu_52d $(date +%T)"
bash .devrun/gpu_52d.sh
echo "== end $(date +%T)"
