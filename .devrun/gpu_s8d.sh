#!/usr/bin/env bash
# needs 1 GPU, ~7 min. Session 8: (1) issue 44 after the register-packed group kernel and one-group-per-row
# ranges (qbench + the record benchmarks/compress_quant.py); (2) issue 41 after the host trims (shared mask
# conversion, one dropout draw, stacked dq/dk/dv, cached spec): host vs GPU time (trace41.py), then the 8-layer
# table at seq 128 and 512 vs HF SDPA and HF eager attention; (3) where DeepSpeed's own layer crashes (fp16,
# faulthandler); (4) gpu_52c.sh ds (DeepSpeed's ZenFlow side by side).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90,code=sm_90 -Icsrc/include -Icsrc/cuda \
    .devrun/qbench.cu -o /tmp/qb 2>&1 | grep -v "declared but never\|^$" | head -5
timeout 60 /tmp/qb 28 > $O/qb.txt 2>&1; grep -A30 "^case" $O/qb.txt | head -12; grep correctness $O/qb.txt
timeout 150 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning" > $O/cq.txt
tail -12 $O/cq.txt
echo "== 41 $(date +%T)"
timeout 90 python3 .devrun/trace41.py 2>&1 | grep -E "GPU step"
timeout 150 python3 benchmarks/transformer_kernel.py --skip-check --no-compile --no-memory --layers 8 --reps 7 \
    --systems hf,hf-eager-attn 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/tk.txt; grep -A5 "^training step" $O/tk.txt
echo "== DeepSpeed layer crash $(date +%T)"
(export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="transformer"; source scripts/device_deepspeed.sh > $O/dsinst.txt 2>&1)
TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real timeout 90 python3 .devrun/ds41_crash.py \
    > $O/ds41.txt 2>&1
echo "ds41 rc=$?"; grep -v "^\s*$" $O/ds41.txt | tail -14
echo "== 52c ds $(date +%T)"
bash .devrun/gpu_52c.sh ds 2>&1 | tee $O/52c.txt | tail -30
