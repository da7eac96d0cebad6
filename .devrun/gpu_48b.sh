#!/usr/bin/env bash
# needs 4 GPUs (one host), <= 150 s. Issue 48, session 5: the 2.7B ZeRO-3 vs FSDP2 comparison again (GPT, seq 2048,
# micro 4, bf16, DeepSpeed's default JSON: automatic units, no granularity threshold) on the tree with the host-overhead
# cuts of session 5 (stage-3 reduce-scatters issued straight on the process group, cheaper gather/release and gradient
# deposit bookkeeping; benchmarks/zero3_host_overhead.py measures them on CPU). Last figure (session 4, call 1):
# 2.7B 112,285 vs 103,827 tokens/s = 1.08x FSDP2, +4.7% peak; the bar is 1.15x.
# Two interleaved rounds of dsc3 then fsdp2 (the median block counts). Correctness first (fsdp2's first 2 losses vs
# dsc3's: "check rel"), then tokens/s, MFU, peak GiB, and --phases: forward / backward / step ms apart (synchronised
# between phases) for the host-vs-device split. Run from the repo root after `source scripts/device_setup.sh`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
T0=$(date +%s)
echo "== GPT 2.7B micro 4, 4 GPUs: dsc3, fsdp2 x 2 rounds $(date +%T)"
timeout 135 python3 benchmarks/train_throughput.py --nprocs 4 --model 2.7B --micro 4 --systems dsc3,fsdp2 \
    --rounds 2 --check 2 --blocks 2 --steps 4 --phases --out $OUT/z3host_2.7B.jsonl 2>&1 \
    | grep -E "^(round|system|dsc|fsdp|NVIDIA|Traceback|[A-Za-z.]*Error)" | cut -c1-330
[ -s $OUT/z3host_2.7B.jsonl ] && python3 benchmarks/train_throughput.py --report $OUT/z3host_2.7B.jsonl 2>&1 | sed -n 2,8p
echo "== done $(( $(date +%s) - T0 )) s"
