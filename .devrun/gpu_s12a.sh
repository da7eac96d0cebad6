#!/usr/bin/env bash
# needs 1 GPU, <= 9.5 min. Session 12: (1) every CUDA unit test on the landed code (session 11 changed autograd paths
# no GPU had run); (2) issue 48's NVMe bar made readable: ZeRO-Infinity side by side with DeepSpeed 0.19.8 with
# stage3_prefetch_bucket_size 0 for both (its parameter swapper ran out of buffers in step 2 with prefetching on).
# Usage: SIZE=760M bash .devrun/gpu_s12a.sh [tests]
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
SIZE=${SIZE:-760M}; BUDGET=${BUDGET:-330}
source scripts/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $O/gpu.txt
if [ "${1:-}" = tests ]; then
  T0=$(date +%s)
  timeout 230 python3 -m pytest -q -p no:cacheprovider -rs $(ls tests/unit/test_*cuda*.py) \
      tests/unit/test_transformer_layer_higher_order.py tests/unit/test_autograd_paths_modules.py > $O/tests.txt 2>&1
  echo "tests rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E "^(FAILED|ERROR)|^E  |passed|failed|SKIPPED" $O/tests.txt | head -40
fi
A=$PWD/.aio/root/usr
export CPATH=$A/include${CPATH:+:$CPATH} LIBRARY_PATH=$A/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$A/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
df -h /tmp | tail -1; free -g | head -2
source scripts/device_deepspeed.sh > $O/ds_install.txt 2>&1; echo "deepspeed install rc=$?"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
python3 -c "
import time; t=time.time()
from deepspeed.ops.op_builder import AsyncIOBuilder
AsyncIOBuilder().load(); print(f'DeepSpeed async_io built in {time.time()-t:.1f}s')" 2>&1 | grep -v -i warn | tail -2
timeout $((BUDGET + 30)) python3 benchmarks/offload_largest.py ${CHECK:-} --mode zero3nvme --impls dsc,ds --size $SIZE \
    --seq 1024 --micro 1 --warmup 1 --steps ${STEPS:-2} --prefetch_bucket 0 --reuse_distance ${REUSE:-0} --budget $BUDGET --nvme_path /tmp/ol_swap \
    --out $O/ol.jsonl --log $O/ol.log 2>&1 | grep -v -i "warn" | tail -24 | tee $O/ol_table.txt
