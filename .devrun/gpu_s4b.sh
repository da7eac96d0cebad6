#!/usr/bin/env bash
# 4 GPUs, <= 300 s: session 4 call 2, one 1-GPU script per lane: 39c | 41b | 45 | 52, then the random-LTD profile (42).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
source scripts/device_setup.sh || exit 2
echo "== setup $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/r
( export CUDA_VISIBLE_DEVICES=0; timeout 170 bash .devrun/gpu_39c.sh > $OUT/r/39c.txt 2>&1 ) & A=$!
( export CUDA_VISIBLE_DEVICES=1; timeout 170 bash .devrun/gpu_41b.sh > $OUT/r/41b.txt 2>&1 ) & B=$!
( export CUDA_VISIBLE_DEVICES=2; timeout 170 bash .devrun/gpu_45.sh > $OUT/r/45.txt 2>&1 ) & C=$!
( export CUDA_VISIBLE_DEVICES=3; timeout 170 bash .devrun/gpu_52.sh > $OUT/r/52.txt 2>&1 ) & D=$!
wait $A; echo "== 39c done $(( $(date +%s) - T0 )) s"
( export CUDA_VISIBLE_DEVICES=0; timeout 90 python3 benchmarks/data_efficiency.py train --layers 24 --seq 2048 --d 1024 --micro 4 --steps 10 --warmup 3 --profile 2>&1 | grep -vE "INFO|Warning|warn\(" > $OUT/r/42p.txt ) & E=$!
wait $B $C $D $E
echo "== all done $(( $(date +%s) - T0 )) s"
for f in 39c 41b 45 52 42p; do echo "######## $f"; tail -c 3000 $OUT/r/$f.txt; echo; done
