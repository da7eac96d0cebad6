#!/usr/bin/env bash
# needs 4 GPUs (one host), <= 280 s. Issue 48 ZeRO-3 memory/speed, DeepSpeed's default JSON (auto units), seq 2048,
# bf16. Call 2 of session 4 (call 1, 16:20: 2.7B 1.08x FSDP2 +4.7% peak, 6.7B 1.10x +12.5%, 1.3B 1.26x +5.2%).
# New since: the gradient partition is made when its first bucket is folded in (not at the activation peak); one sent
# bucket in flight (was 2); the optimizer step all-gathers the next forward's first units once written.
# Arms: dsc3 (all new), dsc3 with 2 buckets in flight, dsc3 without the in-step gather, FSDP2; 6.7B (micro 2) first
# (its peak was over the +10% bar), then 2.7B, then 1.3B (dsc3, fsdp2) as time allows. Correctness first (each
# system's first 2 losses vs dsc3's: "check rel"), then tokens/s, MFU, peak GiB per system, interleaved.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
W2='dsc3@DSC_ZERO_REDUCE_WINDOW=2'
NOPF='dsc3@DSC_Z3_PREFETCH_IN_STEP=0'
OUT=${OUT:-/tmp}
run() {  # model micro systems limit
  local T=$(( 272 - SECONDS )); [ $T -gt $4 ] && T=$4
  [ $T -lt 50 ] && { echo "== $1 skipped: ${SECONDS}s used of 280"; return; }
  echo "== GPT $1 micro $2, 4 GPUs: $3 (limit ${T}s)"
  timeout $T python3 benchmarks/train_throughput.py --nprocs 4 --model $1 --micro $2 --systems "$3" \
    --rounds 1 --check 2 --blocks 2 --steps 4 --out $OUT/z3mem2_$1.jsonl 2>&1 \
    | grep -E "^(round|system|dsc|fsdp|NVIDIA|Traceback|[A-Za-z.]*Error)" | cut -c1-200
  [ -s $OUT/z3mem2_$1.jsonl ] && python3 benchmarks/train_throughput.py --report $OUT/z3mem2_$1.jsonl 2>&1 | sed -n 2,8p
}
run 6.7B 2 "dsc3,$W2,$NOPF,fsdp2" 115
run 2.7B 4 "dsc3,$W2,$NOPF,fsdp2" 100
run 1.3B 4 "dsc3,fsdp2" 70
