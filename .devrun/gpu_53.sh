#!/usr/bin/env bash
# Issue 53 (Domino), needs 2 GPUs: correctness (fp32 tiny, then the 1.3B GPT in bf16: loss and every gradient
# of Domino (inter- and intra-layer) vs our plain TP vs DeepSpeed's Domino), then fwd+bwd tokens/s at TP 2 (interleaved),
# then NCCL time and exposed communication per step from a torch.profiler trace. About 60 s.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# the real DeepSpeed beside ours when its sdist was carried here (scripts/device_deepspeed.sh); else ours only
if [ ! -d /tmp/ds_real/deepspeed ] && [ -f scripts/device_deepspeed.sh ]; then source scripts/device_deepspeed.sh; fi
[ -d /tmp/ds_real/deepspeed ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
timeout 105 python3 benchmarks/domino.py --tp 2 --size 1.3B --seq 1024 --micro 16 --reps 3 --iters 3 --warmup 2 \
    --profile_iters 2 2>&1 | grep -vE "INFO|WARNING|UserWarning|return Variable|built successfully|^\s*$" | tail -30
