#!/usr/bin/env bash
# 4 GPUs, <= 430 s: session 4 call 3: gpu_48.sh (ZeRO-3 memory A/B vs FSDP2, 280 s) while the real DeepSpeed
# installs and builds its fused Adam in the background; then DeepSpeed stage 3 at 2.7B (same JSON) for the 2x bar.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
source scripts/device_setup.sh || exit 2
( export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="fused_adam"; source scripts/device_deepspeed.sh ) > $OUT/ds_install.log 2>&1 &
DSPID=$!
echo "== setup $(( $(date +%s) - T0 )) s"
timeout 290 bash .devrun/gpu_48.sh 2>&1 | tee $OUT/48.txt
echo "== 48 done $(( $(date +%s) - T0 )) s"
wait $DSPID; tail -2 $OUT/ds_install.log
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real TORCH_CUDA_ARCH_LIST=9.0
timeout $(( 420 - ($(date +%s) - T0) )) python3 benchmarks/train_throughput.py --nprocs 4 --model 2.7B --micro 4 \
    --systems ds3 --rounds 1 --check 2 --blocks 2 --steps 3 --out $OUT/ds3_27.jsonl 2>&1 \
    | grep -E "^(round|system|ds|NVIDIA|Traceback|[A-Za-z.]*Error)" | cut -c1-200
[ -s $OUT/ds3_27.jsonl ] && python3 benchmarks/train_throughput.py --report $OUT/ds3_27.jsonl 2>&1 | sed -n 2,6p
echo "== all done $(( $(date +%s) - T0 )) s"
