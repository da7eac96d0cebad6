#!/usr/bin/env bash
# The distributed parity suites over NCCL, one process per GPU (scripts/gpu_parity.py says what runs).
# On a GPU machine without the dev venv: installs the carried wheels and builds the core in place
# (scripts/device_setup.sh), then runs with python3. Other arguments go to gpu_parity.py (-j N,
# --budget S, --suite-timeout S, suite names).
#
#   bash scripts/gpu_parity.sh                 # every suite, each test at its own world size
#   bash scripts/gpu_parity.sh 8 -j 2 --budget 900 zero12 zero3 moe
#   bash scripts/gpu_parity.sh --world 4 zero3
#
# A world size N (first argument, bare or as --world N) makes the run one at N ranks:
#  - N GPUs must be visible (else exit 2, naming the shortfall, before anything runs: a run whose
#    N-rank cases all skip is not a pass); the ranks see the first N (CUDA_VISIBLE_DEVICES);
#  - DSC_PARITY_WORLD=N is exported: a suite adds its cases at N ranks (up to N) under it, kept out of
#    the CPU suites (N gloo ranks on the CI's cores would cost minutes);
#  - a test skipped for a GPU shortfall at a world size <= N fails the run (exit 1).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORLD=""
if [[ "${1:-}" == "--world" || "${1:-}" == "-w" ]]; then
    WORLD=${2:-}
    shift 2 || { echo "gpu_parity.sh: --world needs a number" >&2; exit 2; }
elif [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    WORLD=$1
    shift
fi
if [[ -n "$WORLD" && ! "$WORLD" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_parity.sh: world size must be a positive integer, got '$WORLD'" >&2
    exit 2
fi
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    source scripts/device_setup.sh || exit 2
    PY=python3
fi
export DSC_CACHE_DIR=${DSC_CACHE_DIR:-/tmp/dsc_cache}
if [ -z "$WORLD" ]; then
    exec "$PY" scripts/gpu_parity.py "$@"
fi

HAVE=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if (( HAVE < WORLD )); then
    echo "gpu_parity.sh: a run at $WORLD ranks needs $WORLD CUDA GPUs (one process per GPU); $HAVE visible" >&2
    exit 2
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    CUDA_VISIBLE_DEVICES=$(echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f1-"$WORLD")
else
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((WORLD - 1)))
fi
export CUDA_VISIBLE_DEVICES DSC_PARITY_WORLD=$WORLD
echo "parity at $WORLD ranks: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES DSC_PARITY_WORLD=$WORLD"
LOG=$(mktemp /tmp/gpu_parity_out.XXXXXX)
"$PY" scripts/gpu_parity.py "$@" 2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}
# the harness's skip reason: "NCCL at world size K needs K CUDA GPU(s), one process per GPU; H visible"
SHORT=$(grep -oE "NCCL at world size [0-9]+ needs" "$LOG" | awk -v n="$WORLD" '$5 <= n' | sort -u)
rm -f "$LOG"
if [ -n "$SHORT" ]; then
    echo "FAILED: tests at world sizes <= $WORLD skipped for want of GPUs:" >&2
    echo "$SHORT" | sed 's/^/  /' >&2
    RC=1
fi
exit "$RC"
