#!/usr/bin/env bash
# needs 1 GPU, ~2.5 min. Session 8: issue 44 after the vectorised one-barrier group kernel and the scratch pool:
# qbench (variants vs the new kernel, default-pool control), then the record: benchmarks/compress_quant.py
# (bit-equality table incl. the new per-element/misaligned cases, bandwidth vs copy_). Issue 41: the per-kernel
# profile of ours vs HF. Everything also lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/qbench.cu -o /tmp/qb 2>&1 | grep -v "declared but never\|^$" | head -5
timeout 60 /tmp/qb 28 > $O/qb.txt 2>&1; tail -26 $O/qb.txt
timeout 150 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning" > $O/cq.txt
tail -14 $O/cq.txt
timeout 90 python3 benchmarks/transformer_kernel.py --profile-only 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/prof41.txt
head -30 $O/prof41.txt
