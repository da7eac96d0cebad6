#!/usr/bin/env bash
# needs 1 GPU, ~1.5 min. Session 10 final: exact pinned host buffers (with MADV_DONTFORK) test and the offload
# modes' check; AutoEP at autoep_size 1 on the GPU vs plain PyTorch.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/unit/test_host_memory.py 2>&1 | tail -2
bash .devrun/gpu_s10e.sh 2>&1 | grep -E "SAME|DIFFERENT"
PYTHONPATH=.:${PYTHONPATH:-} timeout 120 python3 .devrun/autoep_gpu.py 2>&1 | grep -E "^AUTOEP|Error|error" | head -12
