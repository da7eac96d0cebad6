#!/usr/bin/env bash
# needs 1 GPU, ~3.5 min. Session 8, issue 41 after the direct cuDNN attention core (sdpa_core.py): its CUDA tests,
# the correctness table against HF BertLayer / float32 references, host vs GPU time, the 8-layer table (15 reps).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/unit/test_transformer_layer_cuda.py 2>&1 | tail -4
timeout 90 python3 benchmarks/transformer_kernel.py --check-only 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/check.txt
tail -4 $O/check.txt
timeout 90 python3 .devrun/trace41.py 2>&1 | grep -E "GPU step"
timeout 200 python3 benchmarks/transformer_kernel.py --skip-check --no-compile --no-memory --layers 8 --reps 15 \
    --systems hf,hf-eager-attn 2>&1 | grep -vE "^\s*$|UserWarning|warn" > $O/tk.txt; grep -A5 "^training step" $O/tk.txt
