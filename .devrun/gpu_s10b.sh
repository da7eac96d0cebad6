#!/usr/bin/env bash
# needs 1 GPU, <= 9.5 min a call. Session 10, issue 48's one-GPU NVMe bar: ZeRO-Infinity (stage 3, parameters and
# optimizer on NVMe swap files) side by side with DeepSpeed 0.19.8 on the same JSON. DeepSpeed's async_io op needs
# libaio, absent on the GPU image: the Debian libaio1/libaio-dev packages are carried unpacked in .aio/root.
# Usage: bash .devrun/gpu_s10b.sh SIZE [BUDGET_S] [--check]
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
SIZE=${1:-1.3B}; BUDGET=${2:-480}; CHECK=${3:-}
A=$PWD/.aio/root/usr
export CPATH=$A/include${CPATH:+:$CPATH} LIBRARY_PATH=$A/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$A/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
df -h / /tmp | tee $O/df.txt
free -g | head -2
source scripts/device_deepspeed.sh > $O/ds_install.txt 2>&1; echo "deepspeed install rc=$?"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
python3 - <<'PY' 2>&1 | grep -v -i warn | tail -4 | tee $O/aio_build.txt
import time
t = time.time()
from deepspeed.ops.op_builder import AsyncIOBuilder
b = AsyncIOBuilder()
print("DeepSpeed async_io compatible:", b.is_compatible(verbose=True))
b.load()
print(f"DeepSpeed async_io built in {time.time() - t:.1f}s")
PY
timeout $((BUDGET + 30)) python3 benchmarks/offload_largest.py $CHECK --mode zero3nvme --impls dsc,ds --size $SIZE \
    --seq 1024 --micro 1 --warmup 1 --steps ${STEPS:-2} --budget $BUDGET --nvme_path /tmp/ol_swap --out $O/ol.jsonl \
    --log $O/ol.log 2>&1 | grep -v -i "warn" | tail -30 | tee $O/ol_table.txt
