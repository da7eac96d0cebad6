#!/usr/bin/env bash
# needs 1 GPU, ~5 min. Session 9 (issue 41): kernel variants (tbench: norm backward prefetch / parts, GELU
# batched loads, Philox keep mask vs copy), the dropout-mask GPU tests, then the 8-layer table with the
# Philox masks at seq 128 and 512 vs HF SDPA and HF eager attention.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/tbench.cu -o /tmp/tb 2>&1 | grep -v "declared but never\|^$\|max_rel\|\^\|Remark" | head -5
timeout 90 /tmp/tb > $O/tb.txt 2>&1; echo "tb rc=$?"; cat $O/tb.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transformer_dropout_cuda.py \
    tests/unit/test_transformer_layer_cuda.py 2>&1 | tail -6 | tee $O/tests.txt
timeout 200 python3 benchmarks/transformer_kernel.py --skip-check --no-compile --no-memory --layers 8 --reps 9 \
    --systems hf,hf-eager-attn 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/tk.txt; grep -A5 "^training step" $O/tk.txt
