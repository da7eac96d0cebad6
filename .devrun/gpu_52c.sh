#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 52, session 7 (UNRUN when written): ZenFlow's speed, timed honestly.
# gpu_52b's zenflow blocks were 534.3 and 167.3 ms/step: its first timed block carried the first host step,
# whose C Adam allocates the host moments (~11 GB zeroed: the 819 ms "each" was a mean over one slow first
# step and three ~650 ms ones; the tail, 628 ms, is a steady host step). Now (benchmarks/offload_steady.py)
# every ZenFlow engine runs untimed warm-up first (two update intervals, the first host step included),
# blocks are whole update intervals (8 steps = 2 host steps) that start right after a boundary handed a
# fresh host step to the background and end the same way; the benchmark counts and asserts the host steps
# each deepspeed_c block took inside the clock (printed "host steps taken in the clock 2/2 per 8 steps");
# the one in flight at a block's end is waited for outside (the tail) before the other engine runs. The
# background host step now uses every core while the training thread is blocked on it (else
# cores * (1 - pt_reserved_cores_perc)).
# 1) deepspeed_c plain ZeRO-Offload vs ZenFlow (topk 0.05, interval 4, overlap), 1.42B GPT, seq 2048, micro 4,
#    bf16, AdamW, clip 1, interleaved; meanwhile DeepSpeed 0.19.8 is installed and its cpu_adam JIT-built in the
#    background: the timing waits for that build (--hold) so it does not share the cores.
# 2) if time is left: deepspeed_c's ZenFlow vs DeepSpeed's ZenFlow, interleaved, in a second process (host
#    memory: two ZenFlow engines besides no offload engine). DeepSpeed's ZenFlow keeps two host steps in
#    flight: its lead-in runs three boundaries. Its losses are not compared: DeepSpeed 0.19.8's ZenFlow
#    views its transposed flat buffer in the weights' shapes at initialize (printed "NOT COMPARABLE").
# Part 2 will likely not fit after part 1 in 150 s: `bash .devrun/gpu_52c.sh ds` runs it alone (<= 150 s).
# Run from the repo root after `source scripts/device_setup.sh`. BENCH_ARGS="--tiny" DS_ACCELERATOR=cpu: a CPU
# dry run of the same commands.
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
FILTER="INFO|WARNING|Warning|warn\(|strip_auto|^\s*$|^\)\)|^    |^Adam|^DeepSpeedCPUAdam|^Parameter Group|is_compiling|^Config:|^Zenflow: clearing"
KEEP="^block|^check|^held|^ZenFlow timing|^host|step .* ms .*tokens/s|^ratio|GPU idle|budget|Error|error|File|Traceback|Thread|^timed|^checked|initialised|^NVIDIA|^GPT"
echo "cores $(nproc); $(lscpu | grep -m1 'Model name' | sed 's/  */ /g'); $(free -g | awk '/Mem:/{print "host mem " $2 " GiB"}'); $(git log -1 --format=%h 2>/dev/null)"
PART=${1:-both}  # both: part 1, then part 2 if time is left; ds: part 2 alone (DeepSpeed set up first)
rm -f /tmp/ds_ready /tmp/ds_ok
( DS_PREBUILD="cpu_adam"; source scripts/device_deepspeed.sh; echo "install status $?"; python3 -c \
    "import deepspeed, sys; sys.exit(deepspeed.__version__ != '0.19.8')" && echo ok >/tmp/ds_ok; touch /tmp/ds_ready ) \
    >/tmp/ds_setup.log 2>&1 &
if [ "$PART" != ds ]; then
    echo "== 1: deepspeed_c plain offload vs ZenFlow (DeepSpeed installing meanwhile; the timing waits for it)"
    timeout 100 python3 benchmarks/offload.py --impls dsc --variants offload,zenflow --baseline 0 --blocks 3 --steps 8 \
        --check 2 --hold /tmp/ds_ready --hold_max 60 --budget 84 --watchdog 97 ${BENCH_ARGS:-} 2>&1 \
        | grep -vE "$FILTER" | grep -E "$KEEP" | tail -24
fi
while [ ! -e /tmp/ds_ready ] && [ "$SECONDS" -lt 105 ]; do sleep 1; done
echo "== DeepSpeed setup (${SECONDS}s): $(grep -E 'built|did not|status' /tmp/ds_setup.log | tr '\n' ' ')"
LEFT=$((148 - SECONDS))
if [ -e /tmp/ds_ok ] && [ "$LEFT" -gt 40 ]; then
    echo "== 2: deepspeed_c ZenFlow vs DeepSpeed 0.19.8 ZenFlow (${LEFT}s left)"
    BLOCKS=$([ "$LEFT" -gt 90 ] && echo 3 || echo 2)
    PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real timeout "$LEFT" python3 benchmarks/offload.py --impls dsc,ds \
        --variants zenflow --baseline 0 --blocks "$BLOCKS" --steps 8 --check 2 --budget $((LEFT - 22)) \
        --watchdog $((LEFT - 2)) ${BENCH_ARGS:-} 2>&1 | grep -vE "$FILTER" | grep -E "$KEEP" | tail -22
else
    echo "== 2 skipped: ${LEFT}s left (run \`bash .devrun/gpu_52c.sh ds\` for it alone); DeepSpeed $([ -e /tmp/ds_ok ] \
        && echo ready || echo 'not importable')"
    tail -5 /tmp/ds_setup.log
fi
echo "(${SECONDS}s)"
