#!/usr/bin/env bash
# 4 GPUs, <= 560 s: session 4 call 1. Lanes: GPU0 gpu_39 then gpu_42; GPU1 gpu_41 then gpu_44;
# GPU2+3 (after DeepSpeed installs) gpu_53 then gpu_39b; then all 4: megatron_3d --layout 3d pp2 tp2.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
source scripts/device_setup.sh || exit 2
export DS_PREBUILD="fused_adam"
(bash -c 'source scripts/device_deepspeed.sh' > $OUT/ds_install.log 2>&1) &
DSPID=$!
echo "== setup $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/r
( export CUDA_VISIBLE_DEVICES=0; timeout 150 bash .devrun/gpu_39.sh > $OUT/r/39.txt 2>&1; timeout 110 bash .devrun/gpu_42.sh > $OUT/r/42.txt 2>&1 ) &
A=$!
( export CUDA_VISIBLE_DEVICES=1; timeout 150 bash .devrun/gpu_41.sh > $OUT/r/41.txt 2>&1; timeout 100 bash .devrun/gpu_44.sh > $OUT/r/44.txt 2>&1 ) &
B=$!
wait $DSPID; echo "== ds installed $(( $(date +%s) - T0 )) s"; tail -3 $OUT/ds_install.log
( export CUDA_VISIBLE_DEVICES=2,3 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real; timeout 130 bash .devrun/gpu_53.sh > $OUT/r/53.txt 2>&1; timeout 130 bash .devrun/gpu_39b.sh > $OUT/r/39b.txt 2>&1 ) &
C=$!
wait $A $B $C
echo "== lanes done $(( $(date +%s) - T0 )) s"
( export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real; timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/megatron_3d.py --layout 3d --pp 2 --tp 2 --dp 1 --stage 1 2>&1 | grep -vE "INFO|WARNING|UserWarning|^\s*$" | tail -25 > $OUT/r/54.txt )
echo "== all done $(( $(date +%s) - T0 )) s"
for f in 39 42 41 44 53 39b 54; do echo "######## $f"; tail -c 2500 $OUT/r/$f.txt; echo; done
