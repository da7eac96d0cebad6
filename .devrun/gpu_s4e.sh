#!/usr/bin/env bash
# 4 GPUs, <= 575 s: session 4 last call, by issue order. Phase 1 (4 GPUs): gpu_48.sh (ZeRO-3 call 2, cut at 195 s),
# gpu_54b.sh (3D fp32 recheck, 110 s), gpu_50b.sh (DeepCompile 2.7B + DeepSpeed's, 110 s); the real DeepSpeed installs
# in the background meanwhile. Phase 2 (one GPU a lane, <= 140 s): 52 | 41c then ci | 45 then 46 | 39c then 42.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
source scripts/device_setup.sh || exit 2
( export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="fused_adam dc"; source scripts/device_deepspeed.sh ) > $OUT/ds_install.log 2>&1 &
DSPID=$!
echo "== setup $(el) s"
mkdir -p $OUT/r
timeout 195 bash .devrun/gpu_48.sh > $OUT/r/48.txt 2>&1
echo "== 48 done $(el) s"
wait $DSPID; cat $OUT/ds_install.log | tail -3
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real TORCH_CUDA_ARCH_LIST=9.0
timeout 110 bash .devrun/gpu_54b.sh > $OUT/r/54b.txt 2>&1
echo "== 54b done $(el) s"
timeout 110 bash .devrun/gpu_50b.sh > $OUT/r/50b.txt 2>&1
echo "== 50b done $(el) s"
lane() {  # gpu, then pairs of (script limit)
  local g=$1; shift
  while [ $# -ge 2 ]; do
    local s=$1 lim=$2; shift 2
    local left=$(( 140 - ($(date +%s) - P2) ))
    [ $left -lt 20 ] && { echo "skipped: no time" > $OUT/r/$s.txt; continue; }
    [ $lim -gt $left ] && lim=$left
    CUDA_VISIBLE_DEVICES=$g timeout $lim bash .devrun/gpu_$s.sh > $OUT/r/$s.txt 2>&1
  done
}
P2=$(date +%s)
lane 0 52 140 & A=$!
lane 1 41c 100 ci 100 & B=$!
lane 2 45b 90 46 100 & C=$!
lane 3 39c 70 42 100 & D=$!
wait $A $B $C $D
echo "== all done $(el) s"
for f in 48 54b 50b 52 41c ci 45b 46 39c 42; do [ -f $OUT/r/$f.txt ] && { echo "######## $f"; tail -c 1500 $OUT/r/$f.txt; echo; }; done
