#!/usr/bin/env bash
# needs 1 GPU, <= 120 s incl. the first-use builds of the multi-tensor ops. Issue 46 (graph_harvesting): the
# stage-0 bf16 step replayed from a CUDA graph vs launched eagerly: losses/weights bit-equal (constant lr and
# WarmupLR), the step recorded and replayed; then engine.step() host time (idle queue) and whole-step time.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 110 python3 benchmarks/graph_harvesting.py --layers 12 --d 512 --steps 15 --reps 4 >/tmp/gh46.log 2>&1
rc=$?
grep -v "INFO\|Warning\|warn(\|^\s\|^)\|Parameter Group" /tmp/gh46.log
[ "$rc" -ne 0 ] && { echo "exit $rc; last lines unfiltered:"; tail -25 /tmp/gh46.log; }
exit 0
