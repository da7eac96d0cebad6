#!/usr/bin/env bash
# needs 1 GPU, ~9 min. Session 9: (1) issue 41's record at BERT-Large depth: 24 layers, seq 128 (batch 64) and
# 512 (batch 16), correctness first, vs HF SDPA / eager attention / compiled, activation memory with the flags;
# (2) issue 52: SuperOffload at ratio 1 and at DeepSpeed's example ratio 0.9 vs plain offload (1.42B GPT).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 300 python3 benchmarks/transformer_kernel.py --reps 9 --systems hf,hf-eager-attn,hf-compile 2>&1 \
    | grep -vE "^\s*$|UserWarning|warn" > $O/tk24.txt
grep -iE "FAIL|correctness" $O/tk24.txt | head -4; grep -A6 "^training step" $O/tk24.txt; grep -iA8 "memory" $O/tk24.txt | tail -12
echo "== 52 $(date +%T)"
FILTER="INFO|WARNING|Warning|warn\(|strip_auto|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group"
timeout 200 python3 benchmarks/offload.py --impls dsc --variants offload,superoffload --baseline 0 \
    --ratio 1,0.9 --blocks 3 --steps 4 --check 2 --profile --budget 170 --watchdog 195 2>&1 \
    | grep -vE "$FILTER" > $O/so.txt; tail -22 $O/so.txt
