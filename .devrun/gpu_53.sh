#!/usr/bin/env bash
# Issue 53 (Domino), needs 2 GPUs. Correctness first (fp32 tiny GPT, then the 1.3B GPT in bf16: loss and every
# gradient of Domino inter-/intra-layer vs our plain TP vs DeepSpeed's Domino), then fwd+bwd tokens/s at TP 2
# (interleaved blocks), then NCCL time and exposed communication per step from a torch.profiler trace.
# If time is left, the same with the TP group's NCCL collectives held to 8 CTAs (fewer SMs taken from compute).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# the real DeepSpeed beside ours when its sdist was carried here (scripts/device_deepspeed.sh); else ours only
if [ ! -d /tmp/ds_real/deepspeed ] && [ -f scripts/device_deepspeed.sh ]; then source scripts/device_deepspeed.sh; fi
[ -d /tmp/ds_real/deepspeed ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
FILTER="INFO|WARNING|UserWarning|return Variable|built successfully|^\s*$"
timeout 100 python3 benchmarks/domino.py --tp 2 --size 1.3B --seq 1024 --micro 16 --reps 3 --iters 3 --warmup 2 \
    --profile_iters 2 2>&1 | grep -vE "$FILTER" | tail -30
echo "(${SECONDS}s so far)"
if [ "$SECONDS" -lt 62 ]; then
    timeout $((115 - SECONDS)) python3 benchmarks/domino.py --tp 2 --size 1.3B --seq 1024 --micro 16 --reps 2 \
        --iters 3 --warmup 1 --profile_iters 1 --tp_max_ctas 8 2>&1 | grep -vE "$FILTER" | grep -v "^  .* vs domino" | tail -16
fi
