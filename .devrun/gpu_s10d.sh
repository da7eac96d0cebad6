#!/usr/bin/env bash
# needs 1 GPU, ~6 min. Session 10: exact-size pinned host buffers (test + ZeRO-Offload at 2.78B with torch's
# allocator vs ours: host memory and tokens/s), then the custom autograd Functions' GPU paths (gpu_s10c).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_host_memory.py 2>&1 | tail -3 | tee $O/host_memory.txt
for exact in 0 1; do
    DSC_EXACT_PINNED=$exact timeout 200 python3 benchmarks/offload_largest.py --size 2.7B --mode zero2 --impls dsc \
        --warmup 1 --steps 3 --out $O/ol_exact$exact.jsonl --log $O/ol_exact$exact.log 2>&1 | grep -E "^\| 2.7B" \
        | sed "s/^/exact=$exact /" | tee -a $O/ol_pinned.txt
done
bash .devrun/gpu_s10c.sh
