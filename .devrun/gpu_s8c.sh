#!/usr/bin/env bash
# needs 1 GPU, ~3.5 min. Session 8: issue 44 after "all loads first" in the group kernels (qbench + the record
# benchmarks/compress_quant.py); issue 41: host-vs-GPU time of a step and chrome traces (.devrun/trace41.py), and
# where DeepSpeed's own layer crashes (faulthandler, fp16).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
(export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="transformer"; source scripts/device_deepspeed.sh > $O/dsinst.txt 2>&1) &
DSP=$!
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/qbench.cu -o /tmp/qb 2>&1 | grep -v "declared but never\|^$" | head -5
timeout 60 /tmp/qb 28 > $O/qb.txt 2>&1; grep -A30 "^case" $O/qb.txt; grep correctness $O/qb.txt
timeout 150 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning" > $O/cq.txt
tail -14 $O/cq.txt
timeout 90 python3 .devrun/trace41.py 2>&1 | grep -vE "^\s*$|UserWarning|warn" | tail -6
wait $DSP; tail -3 $O/dsinst.txt
PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real timeout 60 python3 .devrun/ds41_crash.py > $O/ds41.txt 2>&1
echo "ds41 rc=$?"; grep -v "^\s*$" $O/ds41.txt | tail -25
