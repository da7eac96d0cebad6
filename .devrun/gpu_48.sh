#!/usr/bin/env bash
# needs 4 GPUs (one host), <= 280 s. Issue 48 ZeRO-3 memory: deepspeed_c ZeRO-3 with DeepSpeed's default JSON (auto
# units) new (reduce-scatter buckets finished two launches later instead of at the end of backward; fused step writes
# its bf16 output straight into the param shards, no partition-sized scratch) vs old (same tree, the two env switches
# off) vs FSDP2, GPT 2.7B then 1.3B, seq 2048, micro 4, bf16. Correctness first (each system's first 2 losses vs
# dsc3's, printed as "check rel"), then tokens/s, MFU, peak GiB per system, interleaved in one process.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
OLD='dsc3@DSC_ZERO_REDUCE_WINDOW=0+DSC_Z3_STEP_INTO_SHARD=0'
OUT=${OUT:-/tmp}
for m in 2.7B 1.3B; do
  T=$(( 270 - SECONDS )); [ $T -lt 60 ] && { echo "== $m skipped: ${SECONDS}s used of 280"; continue; }
  [ $m = 2.7B ] && [ $T -gt 160 ] && T=160
  echo "== GPT $m, 4 GPUs: dsc3 new, dsc3 old, fsdp2 (limit ${T}s)"
  timeout $T python3 benchmarks/train_throughput.py --nprocs 4 --model $m --micro 4 --systems "dsc3,$OLD,fsdp2" \
    --rounds 1 --check 2 --blocks 2 --steps 4 --out $OUT/z3mem_$m.jsonl 2>&1 \
    | grep -E "^(round|system|dsc|fsdp|ds3|NVIDIA|H|Traceback|[A-Za-z]*Error)" | cut -c1-220
  python3 benchmarks/train_throughput.py --report $OUT/z3mem_$m.jsonl 2>&1 | tail -8
done
