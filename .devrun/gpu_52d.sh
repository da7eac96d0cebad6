#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 52, session 7 (UNRUN when written): SuperOffload's host worker after its fix.
# Tonight: offload 572.8 ms/step (CPU step 427.8), superoffload 583.8 (0.98x; worker 690.6 ms/step),
# @0.8 487.8 (1.17x; worker 583.5); GPU idle/step offload 304.9, superoffload 391.5. Cause: the worker called the
# C Adam once per 4M-element sub-chunk (~350 calls a step, more per job around them); each call returns into the
# GIL, which the training thread holds while it runs forward/backward Python: up to sys.getswitchinterval() (5 ms)
# of waiting per call, and the training thread lost its GIL slices to the worker in turn. Its OpenMP team was the
# process default (every logical core), not the training thread's count, so one team thread shared a core with the
# training thread (a static schedule waits for it). And the out-of-place (rollback-free) step's 12 bytes/param of
# writes read each line first (write-allocate). Now: one C call per bucket, the GIL switch interval 0.5 ms while a
# SuperOffload engine lives (restored at destroy), the worker's team = the training thread's count capped at
# cores-1 (cpuadam_cores_perc still wins), streaming stores for the out-of-place outputs.
# 1) benchmarks/offload.py: plain offload vs SuperOffload ratio 1 and 0.8, correctness checks first, interleaved,
#    ratios, host timings (the worker's ms/step beside plain's CPU step), GPU idle per step.
# 2) if time is left: benchmarks/superoffload_host.py on this host's cores (the worker's host step vs plain's on
#    64M parameters, bits checked first; training thread spinning Python = holding the GIL).
# Read: "superoffload ... x" ratio (bar 1.3x); "speculation: worker W" against offload's "CPU step C": W <= ~C.
# Run from the repo root after `source scripts/device_setup.sh`. BENCH_ARGS="--tiny" DS_ACCELERATOR=cpu: CPU dry run.
set -uo pipefail
export PYTHONUNBUFFERED=1
FILTER="INFO|WARNING|Warning|warn\(|strip_auto|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group"
echo "cores $(nproc); $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(git log -1 --format=%h 2>/dev/null)"
echo "== 1: plain offload vs SuperOffload (ratio 1, 0.8)"
timeout 118 python3 benchmarks/offload.py --impls dsc --variants offload,superoffload --baseline 0 \
    --ratio 1,0.8 --blocks 2 --steps 4 --check 2 --profile --budget 90 --watchdog 114 ${BENCH_ARGS:-} 2>&1 \
    | grep -vE "$FILTER" | tail -30
if [ "$SECONDS" -lt 128 ]; then
    echo "== 2: host step, plain vs SuperOffload worker (${SECONDS}s so far)"
    timeout $((147 - SECONDS)) python3 benchmarks/superoffload_host.py ${HOST_ARGS:---numel 67108864 --bucket 8000003 \
        --sub 262144 --reps 5} 2>&1 | tail -8
fi
echo "(${SECONDS}s)"
