#!/usr/bin/env bash
# needs 1 GPU, ~2 min. Session 9 (issue 41): norm backward with G rows a block, narrow sum_parts, the sum alone;
# then the per-kernel profile of ours vs HF after the Philox masks.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/tbench.cu -o /tmp/tb 2>&1 | grep -v "declared but never\|^$\|max_rel\|\^\|Remark" | head -5
timeout 90 /tmp/tb > $O/tb.txt 2>&1; echo "tb rc=$?"; grep -v "gelu\|copy\|dropout" $O/tb.txt
timeout 90 python3 benchmarks/transformer_kernel.py --profile-only 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/prof41.txt
head -34 $O/prof41.txt
