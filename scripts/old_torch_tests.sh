#!/usr/bin/env bash
# The older-torch leg (a CI step of .ci/run; runs alone too): one build of `_C` serves every supported torch.
# The `_C` that scripts/setup.sh built in place for the pinned torch (.venv) is imported, unchanged, by a
# second venv holding the oldest supported torch (scripts/requirements-old-torch.txt), which runs the op and
# C-core unit tests (CPU optimizers, partition / bucket / fetch / pipe planners, DLPack views, async I/O,
# MoE gating, the torch-range check) and one 2-rank ZeRO-2 and one 2-rank ZeRO-3 parity test. The file's
# sha256 is printed under both torches and must be the same file.
# The venv is kept under ~/.cache/deepspeed_c (DSC_OLD_TORCH_VENV overrides) and rebuilt only when the
# requirements change; pip's own cache keeps the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=scripts/requirements-old-torch.txt
TORCH=$(sed -n 's/^torch==//p' "$REQ")
VENV=${DSC_OLD_TORCH_VENV:-$HOME/.cache/deepspeed_c/ci-venv-torch$TORCH}
start=$(date +%s)
if ! compgen -G "deepspeed_c/_C*.so" >/dev/null || [ ! -x .venv/bin/python ]; then
    bash scripts/setup.sh  # builds _C in place for the pinned torch
fi
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV (torch $TORCH)"
    rm -rf "$VENV"
    "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q -r "$REQ"
    echo "$want" >"$VENV/.requirements.sha256"
fi
export PYTHONPATH=$PWD  # the checkout's package and its in-place _C; nothing is built for this torch
export OMP_NUM_THREADS=1
DSC_CACHE_DIR=$(mktemp -d -t dsc-old-torch-cache-XXXXXX)
export DSC_CACHE_DIR
trap 'rm -rf "$DSC_CACHE_DIR"' EXIT
IDENT='import hashlib, torch, deepspeed_c._C as c
print(torch.__version__, c.__file__, hashlib.sha256(open(c.__file__, "rb").read()).hexdigest())'
old=$("$VENV/bin/python" -c "$IDENT")
new=$(.venv/bin/python -c "$IDENT")
echo "_C under the oldest torch: $old"
echo "_C under the pinned torch: $new"
case "$old" in "$TORCH"*) ;; *) echo "the old-torch venv does not run torch $TORCH" >&2; exit 1 ;; esac
[ "${old#* }" = "${new#* }" ] || { echo "the two torches did not import the same _C file" >&2; exit 1; }
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout=600 -n 2 --dist loadfile \
    tests/unit/test_cpu_optimizers.py tests/unit/test_cpu_multi_tensor.py tests/unit/test_cpu_adam_subgroup.py \
    tests/unit/test_partition.py tests/unit/test_bucket_plan.py tests/unit/test_fetch_plan.py \
    tests/unit/test_pipe_schedule.py tests/unit/test_tensor_view.py tests/unit/test_aio_handle.py \
    tests/unit/test_moe_gating.py tests/unit/test_pipe_topology.py tests/unit/test_torch_range.py \
    "tests/distributed/test_zero12_flat_params.py::test_flat_params_train_like_float64_adamw[2-2-fp32]" \
    "tests/distributed/test_zero3_meta_init.py::test_skip_init_modules_partition_and_train_like_pytorch[2]"
echo "older torch ($TORCH): the same _C passed; $(( $(date +%s) - start ))s"
