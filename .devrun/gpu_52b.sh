#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 52, session 5 rerun (UNRUN when written): the comparison of gpu_52.sh after the
# gradient coefficient went into the C CPU Adam (grad_scale: plain offload and SuperOffload read the bf16
# gradient and scale it in the kernel instead of making a scaled fp32 copy per sub-chunk when clipping is
# active; ZenFlow's interval mean is the host step's grad_scale instead of a device pass over the accumulator).
# One H200, ~1.4B GPT, seq 2048, micro 4, bf16, AdamW, clip 1.0; plain ZeRO-Offload / ZenFlow (topk 0.05,
# interval 4, overlap) / SuperOffload ratio 1 and 0.8, in one process: correctness checks first (each variant's
# first losses against plain offload's, SuperOffload's device weights against its host masters), then
# interleaved timed blocks, ratios to plain offload, per-engine host timings (CPU step, C Adam per host step),
# then GPU idle per step. Last session (gpu_52.sh): offload 765.8 ms/step, zenflow 307.6 (2.49x, bar 3x),
# superoffload 574.7 (1.33x), @0.8 520.1 (1.47x). Note: a faster plain offload lowers the ZenFlow ratio.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
FILTER="INFO|WARNING|Warning|warn\(|strip_auto|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group"
echo "cores $(nproc); $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(git log -1 --format=%h 2>/dev/null)"
timeout 132 python3 benchmarks/offload.py --impls dsc --variants offload,zenflow,superoffload --baseline 0 \
    --ratio 1,0.8 --blocks 2 --steps 4 --check 2 --profile --budget 100 --watchdog 128 2>&1 \
    | grep -vE "$FILTER" | tail -40
if [ "$SECONDS" -lt 136 ]; then  # time left: the host kernel alone, old vs folded coefficient, bits checked
    echo "== host step kernel (${SECONDS}s so far)"
    timeout $((147 - SECONDS)) python3 benchmarks/zenflow_host_step.py --log2n 25 --reps 3 --topk 0.05 2>&1 | tail -6
fi
echo "(${SECONDS}s)"
