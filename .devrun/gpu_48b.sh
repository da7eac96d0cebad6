#!/usr/bin/env bash
# needs 4 GPUs (one host), <= 150 s. Issue 48, session 5: the 2.7B ZeRO-3 vs FSDP2 comparison again (GPT, seq 2048,
# micro 4, bf16, DeepSpeed's default JSON: automatic units, no granularity threshold) on the tree with the host-overhead
# cuts of session 5 (stage-3 reduce-scatters issued straight on the process group, cheaper gather/release and gradient
# deposit bookkeeping: -19% Python calls a step in benchmarks/zero3_host_overhead.py on CPU). Last figure (session 4,
# call 1): 2.7B 112,285 vs 103,827 tokens/s = 1.08x FSDP2, +4.7% peak; the bar is 1.15x.
# Call A: dsc3 then fsdp2, then --profile per system: per phase (forward / backward / step) the host enqueue time
# (until the call returns) against the wall (until the GPU is done), GPU compute vs NCCL time, host stalls, top host
# ops: the host-vs-device split the issue asks for. Call B (when time is left): fsdp2 then dsc3, no profile, a second
# ratio in the other order. Each: correctness first (fsdp2's first 2 losses vs dsc3's: "check rel"), then tokens/s,
# MFU, peak GiB. Run from the repo root after `source scripts/device_setup.sh`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
run() {  # tag systems limit extra-args
  local T=$(( 145 - SECONDS )); [ $T -gt $3 ] && T=$3
  [ $T -lt 45 ] && { echo "== $1 skipped: ${SECONDS}s used of 150"; return; }
  echo "== $1: GPT 2.7B micro 4, 4 GPUs: $2 (limit ${T}s, $(date +%T))"
  timeout $T python3 benchmarks/train_throughput.py --nprocs 4 --model 2.7B --micro 4 --systems "$2" \
    --rounds 1 --check 2 --blocks 2 --steps 4 $4 --out $OUT/z3host_$1.jsonl 2>&1 \
    | grep -vE "INFO|WARNING|UserWarning|^\s*$|^W[0-9]{4} " | grep -E "^(round|system|dsc|fsdp|NVIDIA|Traceback|[A-Za-z.]*Error|---|phase|forward|backward|step |GPU kernel|top |host-side|  )" \
    | cut -c1-200
  [ -s $OUT/z3host_$1.jsonl ] && python3 benchmarks/train_throughput.py --report $OUT/z3host_$1.jsonl 2>&1 | sed -n 2,6p
}
run A "dsc3,fsdp2" 95 --profile
run B "fsdp2,dsc3" 60 ""
echo "== done ${SECONDS} s"
