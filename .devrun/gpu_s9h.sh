#!/usr/bin/env bash
# needs 1 GPU, ~2.5 min. Session 9 final check of the landed tree: the GPU test files of this session's kernels
# (transformer layer, inference incl. Mixtral and quant), the CUDA optimizers (the reducer's factor change is
# CPU-tested; this runs the fused optimizers' own paths), the hybrid engine's tests (fuse_lora_weight).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/unit/test_transformer_kernels_cuda.py \
    tests/unit/test_transformer_layer_cuda.py tests/unit/test_inference_kernels_cuda.py \
    tests/unit/test_inference_quant_cuda.py tests/unit/test_cuda_optimizers.py 2>&1 \
    | grep -E "^(FAILED|ERROR)|^E  |passed|failed" | head -30 | tee $O/final.txt
