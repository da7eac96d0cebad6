#!/usr/bin/env bash
# The C cores under AddressSanitizer + UndefinedBehaviorSanitizer (a CI step of .ci/run; runs alone too):
#  1. builds `_C` with DSC_SANITIZE=1 into build/sanitize/ (setup.py never writes a sanitized `_C` in place);
#  2. runs the fuzz drivers of the fetch planner, the bucket planner and the async I/O core, each for
#     DSC_FUZZ_SECONDS (default 15), built with the same sanitizers (leak checking on), beside
#  3. the C-core unit tests (CPU optimizers, partition / bucket / fetch / pipe / fused-step planners and their
#     property tests, DLPack views, async I/O, MoE gating, the index merge) in a Python whose `_C` is the
#     sanitized one (DSC_CORE_DIR) and whose JIT ops are built with the sanitizers too (DSC_SANITIZE=1, a
#     private op cache), libasan preloaded. Any sanitizer report fails the step: every report is also written under
#     build/sanitize/reports/, and a report there fails it even when the process that wrote it was a
#     subprocess whose exit a test tolerated.
# Needs the setup of scripts/setup.sh (.venv) and gcc with libasan/libubsan.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
FUZZ_SECONDS=${DSC_FUZZ_SECONDS:-15}
OUT=$PWD/build/sanitize
REPORTS=$OUT/reports
# shellcheck disable=SC2054  # the comma belongs to the flag
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1)
rm -rf "$REPORTS" "$OUT/fuzz"
mkdir -p "$REPORTS" "$OUT/fuzz/aio"
start=$(date +%s)

# --force: setuptools would keep an older build whose .c files did not change while a header did
DSC_SANITIZE=1 "$PY" setup.py -q build_ext --force -j 2 >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
test -f "$OUT"/deepspeed_c/_C*.so

# the fuzz drivers: built here, run in the background while the unit tests run
CC_FUZZ=(gcc -std=c11 "${SAN[@]}" -Wall -Wextra -Werror -Icsrc/include)
"${CC_FUZZ[@]}" -include tests/unit/csrc/fetch_plan_fail_alloc.h -c csrc/core/fetch_plan.c -o "$OUT/fuzz/fetch_plan.o"
"${CC_FUZZ[@]}" tests/unit/csrc/fetch_plan_fuzz.c "$OUT/fuzz/fetch_plan.o" -o "$OUT/fuzz/fetch_plan_fuzz"
"${CC_FUZZ[@]}" tests/unit/csrc/bucket_plan_fuzz.c csrc/core/bucket_plan.c -o "$OUT/fuzz/bucket_plan_fuzz"
"${CC_FUZZ[@]}" -pthread tests/unit/csrc/aio_fuzz.c csrc/core/async_io.c csrc/core/async_io_uring.c \
    -o "$OUT/fuzz/aio_fuzz"
fuzz_env=(env "ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:log_path=$REPORTS/fuzz-asan"
          "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/fuzz-ubsan")
declare -A fuzz_pid
for drv in fetch_plan_fuzz bucket_plan_fuzz; do
    "${fuzz_env[@]}" "$OUT/fuzz/$drv" "$FUZZ_SECONDS" >"$OUT/fuzz/$drv.out" 2>&1 & fuzz_pid[$drv]=$!
done
"${fuzz_env[@]}" "$OUT/fuzz/aio_fuzz" "$OUT/fuzz/aio" "$FUZZ_SECONDS" >"$OUT/fuzz/aio_fuzz.out" 2>&1 &
fuzz_pid[aio_fuzz]=$!

# the unit tests in a sanitized process
LIBASAN=$(gcc -print-file-name=libasan.so)
test -f "$LIBASAN" || { echo "libasan.so not found (gcc -print-file-name=libasan.so)" >&2; exit 1; }
# libstdc++ preloaded beside it: ASan's __cxa_throw interceptor needs the real one at start-up, or the
# first C++ exception torch throws (a bad argument to a torch op) aborts in ASan's own CHECK
PRELOAD="$LIBASAN:$(gcc -print-file-name=libstdc++.so)"
cache=$(mktemp -d -t dsc-sanitize-cache-XXXXXX)
trap 'kill "${fuzz_pid[@]}" 2>/dev/null || true; rm -rf "$cache"' EXIT  # no driver outlives a failed step
san_env=(env DSC_SANITIZE=1 DSC_CORE_DIR="$OUT/deepspeed_c" DSC_CACHE_DIR="$cache" OMP_NUM_THREADS=1
         LD_PRELOAD="$PRELOAD"
         ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$REPORTS/asan"
         UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan")
# the tests below must really run the sanitized code: the core module from build/sanitize, libasan loaded,
# the ops' compile and link commands carrying the sanitizer flags
"${san_env[@]}" "$PY" - "$OUT" <<'PY'
import sys

import deepspeed_c._C as core
from deepspeed_c.ops.op_builder import CPUAdamBuilder

assert core.__file__.startswith(sys.argv[1]), f"_C came from {core.__file__}, not the sanitizer build"
assert "libasan" in open("/proc/self/maps").read(), "libasan is not loaded"
assert "-fsanitize=address,undefined" in CPUAdamBuilder().cxx_args(), "the JIT ops would build unsanitized"
print(f"sanitized core module: {core.__file__}")
PY
set +e
# a sanitizer report aborts the worker: no replacement worker (each would import torch under ASan again)
"${san_env[@]}" "$PY" -m pytest -q -p no:cacheprovider --timeout=600 --durations=10 -n 2 --dist loadfile --max-worker-restart=0 \
    tests/unit/test_cpu_optimizers.py tests/unit/test_cpu_multi_tensor.py tests/unit/test_cpu_adam_subgroup.py \
    tests/unit/test_partition.py tests/unit/test_bucket_plan.py tests/unit/test_fetch_plan.py \
    tests/unit/test_pipe_schedule.py tests/unit/test_tensor_view.py tests/unit/test_aio_handle.py \
    tests/unit/test_moe_gating.py tests/unit/test_pipe_topology.py tests/unit/test_fused_step_plan.py \
    tests/unit/test_index_merge.py tests/unit/test_host_memory.py
tests_rc=$?
fuzz_rc=0
for drv in "${!fuzz_pid[@]}"; do
    wait "${fuzz_pid[$drv]}" || { echo "fuzz driver $drv failed:"; cat "$OUT/fuzz/$drv.out"; fuzz_rc=1; }
    grep -qx ok "$OUT/fuzz/$drv.out" || fuzz_rc=1
done
set -e
if compgen -G "$REPORTS/*" >/dev/null; then
    echo "sanitizer reports:" >&2
    for f in "$REPORTS"/*; do echo "== $f" >&2; cat "$f" >&2; done
    exit 1
fi
[ "$tests_rc" -eq 0 ] || { echo "unit tests under the sanitizers failed (pytest exit $tests_rc)" >&2; exit 1; }
[ "$fuzz_rc" -eq 0 ] || { echo "a fuzz driver failed" >&2; exit 1; }
echo "sanitizers: _C and the CPU ops clean under ASan+UBSan; fuzz drivers ${FUZZ_SECONDS}s each clean;" \
     "$(( $(date +%s) - start ))s"
