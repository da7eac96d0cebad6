#!/usr/bin/env bash
# needs 1 GPU, ~2.5 min. Session 8 final check: fake quant (group_params refactor; >65535 two-pass groups case),
# the transformer layer's CUDA tests (incl. the per-shape cuDNN refusal).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 150 python3 benchmarks/compress_quant.py --log2 28 --reps 5 --rounds 3 2>&1 | grep -v "INFO\|Warning" > $O/cq.txt
grep -E "FAILED|correctness" $O/cq.txt; tail -10 $O/cq.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_transformer_layer_cuda.py 2>&1 | tail -4
