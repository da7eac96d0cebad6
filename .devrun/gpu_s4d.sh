#!/usr/bin/env bash
# 4 GPUs, <= 580 s: session 4 call 4: the real DeepSpeed installed (fused_adam prebuilt), then gpu_54.sh (Megatron 3D,
# <= 200 s) and gpu_50.sh (DeepCompile, <= 280 s).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
source scripts/device_setup.sh || exit 2
export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="fused_adam"
source scripts/device_deepspeed.sh
echo "== setup + DeepSpeed $(( $(date +%s) - T0 )) s"
timeout 210 bash .devrun/gpu_54.sh 2>&1 | tee $OUT/54.txt | tail -60
echo "== 54 done $(( $(date +%s) - T0 )) s"
timeout $(( 570 - ($(date +%s) - T0) )) bash .devrun/gpu_50.sh 2>&1 | tee $OUT/50.txt | tail -70
echo "== all done $(( $(date +%s) - T0 )) s"
