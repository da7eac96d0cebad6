#!/usr/bin/env bash
# ONE GPU of the 2x H200 host (256 GiB host memory, 32 cores), <= 290 s; on the 1x kind (128 GiB host: no room for 13B's
# 226 GiB) the sizes drop to 6.7B (ours alone) and 2.7B (both) by themselves
# including the real DeepSpeed's install and cpu_adam prebuild. Issue 48 bar: "one GPU with CPU offload: at least a 13B
# GPT trains, at least 1.2x DeepSpeed's tokens/s at the largest size both fit". benchmarks/offload_largest.py,
# ZeRO-Offload = stage 2 + offload_optimizer cpu (pinned), bf16, AdamW (each system's CPU Adam), clip 1.0, GPT-3 shapes,
# vocab 50304, seq 1024, micro 4, the same JSON for both; each system in its own process (host memory), killed at its
# limit. Order (DeepSpeed's install runs niced in the background during phase 1, which needs no DeepSpeed):
#   1. 13B (13.1B params) ours: trains? tokens/s, init s, peak host RSS / GPU  (the record; no ratio taken from it)
#   2. correctness: small GPT, one process, deepspeed_c vs DeepSpeed losses (zero2 offload), bf16 tol 2e-2, the loss
#      must fall by more than that over the steps (zero3 offload: `--check --mode zero2,zero3`, not run here for time)
#   3. 6.7B (6.86B params) ours then DeepSpeed's, after the check, nothing else running: the ratio; then DeepSpeed's
#      13B if >= 100 s are left (unlikely: expect ~90 s for 1, ~25 for 2, ~50-70 each for 3)
#   4. one table of every run + ratio lines
# `bash .devrun/gpu_48d.sh 13B`: a second call for the 13B ratio (1: ours, 2: zero2 check, 3: DeepSpeed's 13B).
# Run from the repo root (sources scripts/device_setup.sh itself unless already sourced).
# SMOKE=1 (CPU check of this script): tiny GPT for both sizes, fp32/gloo, the DeepSpeed already in /tmp/ds_real.
set -u
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp}
R=$OUT/ol_48d.jsonl; L=$OUT/ol_48d.log; rm -f $R $L
WHAT=${1:-6.7B}
ts() { echo "== $(date -u +%T) +${SECONDS}s $*"; }
left() { echo $(( 285 - SECONDS )); }
PY=python3; S13=13B; S67=6.7B; TINY=""
if [ -n "${SMOKE:-}" ]; then
  PY=.venv/bin/python; S13=tiny; S67=tiny; TINY=--tiny; export DS_ACCELERATOR=cpu
  ( sleep 3; echo "(SMOKE: DeepSpeed install skipped)" ) > $OUT/ds_install_48d.log 2>&1 &
else
  [ -n "${DSC_CACHE_DIR:-}" ] || source scripts/device_setup.sh || exit 2
  MEM_GIB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576 ))
  if [ $MEM_GIB -lt 200 ]; then  # the 1x H200 kind (128 GiB): 13B cannot fit (226 GiB); try 6.7B, compare at 2.7B
    S13=6.7B; S67=2.7B; ts "host has ${MEM_GIB} GiB: sizes lowered to $S13 (ours alone) and $S67 (both)"
  fi
  ts "setup done; $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); $(nproc) CPUs"
  ( export DS_PREBUILD="cpu_adam"; nice -n 19 bash -c 'source scripts/device_deepspeed.sh' ) > $OUT/ds_install_48d.log 2>&1 &
fi
DSPID=$!
ts "DeepSpeed install started (nice 19, background)"
B=($PY benchmarks/offload_largest.py --mode zero2 --out $R --log $L $TINY)

ts "1. $S13 ZeRO-Offload, deepspeed_c (limit 125 s)"
timeout 130 "${B[@]}" --size $S13 --impls dsc --warmup 1 --steps 2 --budget 125 | grep -v "^|"

wait $DSPID; ts "DeepSpeed install: $(tail -2 $OUT/ds_install_48d.log | tr '\n' ' ')"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real${SMOKE:+:/tmp/ds_deps}
if [ "$WHAT" = 13B ]; then
  ts "2. correctness (zero2), small GPT, both in one process"
  timeout 50 "${B[@]}" --check --impls dsc,ds --check_steps 4 --budget 45 || { ts "check failed: stop"; exit 1; }
  T=$(left); ts "3. $S13 ZeRO-Offload, DeepSpeed (limit ${T} s)"
  timeout $((T + 3)) "${B[@]}" --size $S13 --impls ds --warmup 1 --steps 2 --budget $T | grep -v "^|"
else
  ts "2. correctness (zero2), small GPT, both in one process"
  timeout 50 "${B[@]}" --check --impls dsc,ds --check_steps 4 --budget 45 || { ts "check failed: stop"; exit 1; }
  T=$(left); ts "3. $S67 ZeRO-Offload, deepspeed_c then DeepSpeed (limit ${T} s, each child <= 100 s)"
  timeout $((T + 3)) "${B[@]}" --size $S67 --impls dsc,ds --warmup 1 --steps 2 --budget $T --timeout 100 | grep -v "^|"
  T=$(left)
  if [ $T -ge 100 ]; then
    ts "3b. time left: $S13 ZeRO-Offload, DeepSpeed (limit ${T} s)"
    timeout $((T + 3)) "${B[@]}" --size $S13 --impls ds --warmup 1 --steps 2 --budget $T | grep -v "^|"
  else
    ts "3b. DeepSpeed's $S13 skipped: ${T} s left (run: bash .devrun/gpu_48d.sh 13B)"
  fi
fi
ts "4. all runs (columns: build/init/first-step seconds, median s/step of the timed steps, tokens/s = micro*seq/(s/step))"
$PY benchmarks/offload_largest.py --report $R
ts "done (full child output: $L)"
