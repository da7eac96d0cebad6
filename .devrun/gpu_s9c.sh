#!/usr/bin/env bash
# needs 1 GPU, ~7 min. Session 9 (issue 41): the norm backward's two-rows-a-block launcher (tbench, bit-equal to
# one row a block) and the stacked QKV gradient; the GPU tests; the pieces' correctness table; then the record:
# 8 BERT-Large layers at seq 128 and 512 (correctness check first) vs HF SDPA, HF eager attention, HF compiled.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/tbench.cu -o /tmp/tb 2>&1 | grep -v "declared but never\|^$\|max_rel\|\^\|Remark" | head -5
timeout 90 /tmp/tb > $O/tb.txt 2>&1; echo "tb rc=$?"; grep "cur parts4\|groups2 parts4\|production" $O/tb.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transformer_kernels_cuda.py \
    tests/unit/test_transformer_layer_cuda.py tests/unit/test_cuda_build.py 2>&1 | tail -4 | tee $O/tests.txt
timeout 100 python3 benchmarks/transformer_pieces.py 2>&1 | grep -v "Warning" > $O/pieces.txt; grep -c FAIL $O/pieces.txt
tail -14 $O/pieces.txt
timeout 340 python3 benchmarks/transformer_kernel.py --no-memory --layers 8 --reps 15 \
    --systems hf,hf-eager-attn,hf-compile 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/tk.txt
grep -iE "FAIL|PASS|correct" $O/tk.txt | head -5; grep -A6 "^training step" $O/tk.txt
