#!/usr/bin/env bash
# needs 4 GPUs (one host), <= 280 s. Issue 48 ZeRO-3 memory, DeepSpeed's default JSON (auto units), seq 2048, bf16:
# deepspeed_c ZeRO-3 new (gradient buckets sent in backward order, so reduce-scatters overlap the backward instead of
# all going out after its last hook; sent buckets finished two launches later instead of at the end of backward;
# the fused step writes its bf16 output straight into the param shards; the step all-gathers the next forward's
# first units once written; reuse distance counted as DeepSpeed counts) vs new without the in-step gather vs old
# (all but the reuse change switched off by env; that one is compiled in) vs FSDP2 at 2.7B (micro 4), then
# new vs FSDP2 at 6.7B (micro 2) and 1.3B (micro 4) as time allows. Correctness first (each system's first 2 losses
# vs dsc3's: "check rel"), then tokens/s, MFU, peak GiB per system, interleaved in one process.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
OLD='dsc3@DSC_ZERO_REDUCE_WINDOW=0+DSC_Z3_STEP_INTO_SHARD=0+DSC_Z3_REDUCE_ORDER=plan+DSC_Z3_PREFETCH_IN_STEP=0'
NOPF='dsc3@DSC_Z3_PREFETCH_IN_STEP=0'
OUT=${OUT:-/tmp}
run() {  # model micro systems limit
  local T=$(( 272 - SECONDS )); [ $T -gt $4 ] && T=$4
  [ $T -lt 50 ] && { echo "== $1 skipped: ${SECONDS}s used of 280"; return; }
  echo "== GPT $1 micro $2, 4 GPUs: $3 (limit ${T}s)"
  timeout $T python3 benchmarks/train_throughput.py --nprocs 4 --model $1 --micro $2 --systems "$3" \
    --rounds 1 --check 2 --blocks 2 --steps 4 --out $OUT/z3mem_$1.jsonl 2>&1 \
    | grep -E "^(round|system|dsc|fsdp|NVIDIA|Traceback|[A-Za-z.]*Error)" | cut -c1-200
  [ -s $OUT/z3mem_$1.jsonl ] && python3 benchmarks/train_throughput.py --report $OUT/z3mem_$1.jsonl 2>&1 | sed -n 2,8p
}
run 2.7B 4 "dsc3,$NOPF,$OLD,fsdp2" 150
run 6.7B 2 "dsc3,fsdp2" 90
run 1.3B 4 "dsc3,fsdp2" 90
