#!/usr/bin/env bash
# The distributed parity suites over NCCL, one process per GPU (scripts/gpu_parity.py says what runs).
# On a GPU machine without the dev venv: installs the carried wheels and builds the core in place
# (scripts/device_setup.sh), then runs with python3. Arguments go to gpu_parity.py (-j N, suite names).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    source scripts/device_setup.sh || exit 2
    PY=python3
fi
export DSC_CACHE_DIR=${DSC_CACHE_DIR:-/tmp/dsc_cache}
exec "$PY" scripts/gpu_parity.py "$@"
