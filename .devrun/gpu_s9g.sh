#!/usr/bin/env bash
# needs 1 GPU, ~7 min. Session 9, issue 39: MoE inference decode. GPU tests of the injected paths (incl. Mixtral,
# the moe_gemv kernel), then benchmarks/inference_moe.py: Mixtral-shaped 8 layers (11.5B), batch 1, bf16, ours
# (injected, expert GEMVs, CUDA graph) vs HF (sdpa / eager attention) vs the real DeepSpeed 0.19.8's init_inference.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_inference_kernels_cuda.py 2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -24 \
    | tee $O/tests.txt
export TORCH_CUDA_ARCH_LIST=9.0
source scripts/device_deepspeed.sh > $O/dsinst.txt 2>&1; tail -3 $O/dsinst.txt
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
timeout 330 python3 benchmarks/inference_moe.py --layers 8 --new 32 --reps 3 2>&1 \
    | grep -vE "INFO|WARNING|Warning|warn|^\s*$" > $O/moe.txt; tail -16 $O/moe.txt
