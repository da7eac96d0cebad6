#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 52 (offload): one H200, ~1.4B GPT, seq 2048, micro 4, bf16, AdamW, clip 1.0.
# One process (the last call spent 95 s building four 1.4B engines: now the model is built on the GPU and the
# no-offload engine is left out, its 142.8 ms/step known): plain ZeRO-Offload / ZenFlow (default knobs, interval
# 4, steady state: a block starts and ends with one host step in flight, the last waited for outside the clock,
# printed as "tail") / SuperOffload ratio 1 and 0.8 (deferred step: the next forward takes each bucket as it is
# stepped; timed the same way: one untimed step first, the deferred work left at the end waited for outside).
# Correctness checks first, then interleaved blocks, per-engine host timings, ratios, then GPU idle per step;
# a run about to be cut prints every thread's stack (--watchdog). Each phase prints when it ended. If under 75 s
# were spent, plain offload vs SuperOffload ratio 1 at clip 0 (its speculation commits) in a second process.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
FILTER="INFO|WARNING|Warning|warn\(|strip_auto|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group"
echo "cores $(nproc); $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(free -g | awk '/Mem:/{print "host mem " $2 " GiB"}')"
timeout 145 python3 benchmarks/offload.py --impls dsc --variants offload,zenflow,superoffload --baseline 0 \
    --ratio 1,0.8 --blocks 2 --steps 4 --check 2 --profile --budget 100 --watchdog 140 2>&1 | grep -vE "$FILTER" | tail -45
if [ "$SECONDS" -lt 75 ]; then  # time left: SuperOffload's speculation (clip 0: every step can commit)
    echo "== clip 0 (${SECONDS}s so far)"
    LEFT=$((147 - SECONDS))
    timeout $LEFT python3 benchmarks/offload.py --impls dsc --variants offload,superoffload --baseline 0 --clip 0 \
        --blocks 1 --steps 4 --check 2 --watchdog $((LEFT - 3)) 2>&1 | grep -vE "$FILTER" | grep -E "step |ratio|check|host|Error|File" | tail -12
fi
echo "(${SECONDS}s)"
