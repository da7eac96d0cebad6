#!/usr/bin/env bash
# needs 1 GPU, ~5 min. Session 9, issue 39: host time of a generate() token (profile), then the quant section at
# 8 layers and at LLaMA-7B depth (32 layers): decode ms/token through generate and the captured step, vs bf16.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 150 python3 .devrun/prof39.py 8 > $O/prof39.txt 2>&1; echo "prof rc=$?"; grep "ms/token" $O/prof39.txt
grep -A30 "Ordered by: internal time" $O/prof39.txt | head -34
timeout 250 python3 benchmarks/inference_rest.py quant --layers 32 --new 64 --reps 3 2>&1 | grep -vE "Warning|warn" \
    > $O/q32.txt; tail -12 $O/q32.txt
