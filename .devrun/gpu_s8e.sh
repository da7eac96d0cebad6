#!/usr/bin/env bash
# needs 1 GPU, ~3 min. Session 8: issue 41 after the second host trims (weights on ctx, unbind): host vs GPU time,
# then the 8-layer table (15 interleaved reps) at seq 128 and 512; issue 52: SuperOffload's worker host step on
# this host's cores (benchmarks/superoffload_host.py, fixed import path).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 90 python3 .devrun/trace41.py 2>&1 | grep -E "GPU step"
timeout 200 python3 benchmarks/transformer_kernel.py --skip-check --no-compile --no-memory --layers 8 --reps 15 \
    --systems hf,hf-eager-attn 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/tk.txt; grep -A5 "^training step" $O/tk.txt
timeout 60 python3 benchmarks/superoffload_host.py --numel 67108864 --bucket 8000003 --sub 262144 --reps 5 2>&1 | tail -8
