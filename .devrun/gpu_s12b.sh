#!/usr/bin/env bash
# needs 1 GPU, ~4 min. Session 12's final tree on the GPU: the CUDA unit tests, the optimizer-role and sparse-name
# tests on cuda-visible torch, and a ZeRO-Infinity NVMe smoke (the async-I/O descriptor retry changed).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
source scripts/device_setup.sh
timeout 260 python3 -m pytest -q -p no:cacheprovider $(ls tests/unit/test_*cuda*.py) tests/unit/test_optimizer_roles.py \
    tests/unit/test_sparse_tensor_names.py tests/unit/test_aio_handle.py > $O/tests.txt 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests.txt | head -20
timeout 200 python3 benchmarks/offload_largest.py --mode zero3nvme --impls dsc --size small --seq 256 --micro 2 \
    --warmup 1 --steps 3 --nvme_path /tmp/ol_swap --log $O/ol.log 2>&1 | tail -4
