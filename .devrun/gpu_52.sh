#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 52 (offload): one H200, ~1.4B GPT, seq 2048, micro 4, bf16, AdamW.
# A (clip 1.0, the issue's config): no offload / plain ZeRO-Offload / ZenFlow (default knobs, interval 4, steady
#   state: a block starts and ends with one host step in flight, the last waited for outside the clock and printed
#   as "tail") / SuperOffload ratio 1 (deferred step: the next forward takes each bucket as it is stepped);
#   correctness checks first, then interleaved blocks, per-engine host timings, ratios, then GPU idle per step
#   (--profile); a run about to be cut prints every thread's stack (--watchdog).
# B (if time is left; clip 0: SuperOffload's speculation can commit): plain offload vs SuperOffload ratio 1 and 0.8.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
FILTER="INFO|WARNING|Warning|warn\(|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo "cores $(nproc); $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(free -g | awk '/Mem:/{print "host mem " $2 " GiB"}')"
echo "== A clip 1.0 ($(date +%T))"
timeout 95 python3 benchmarks/offload.py --impls dsc --variants offload,zenflow,superoffload --blocks 2 --steps 8 \
    --check 3 --profile --watchdog 88 2>&1 | grep -vE "$FILTER" | tail -45
echo "== B clip 0 (${SECONDS}s so far)"
if [ "$SECONDS" -lt 85 ]; then
    LEFT=$((148 - SECONDS))
    timeout $LEFT python3 benchmarks/offload.py --impls dsc --variants offload,superoffload --ratio 1,0.8 --clip 0 \
        --blocks 1 --steps 8 --check 2 --profile --watchdog $((LEFT - 4)) 2>&1 | grep -vE "$FILTER" | tail -40
fi
echo "(${SECONDS}s)"
