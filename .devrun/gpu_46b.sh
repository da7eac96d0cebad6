#!/usr/bin/env bash
# needs 4 GPUs, <= 150 s. Issue 46 (MiCS), one GPU a rank (NCCL):
# 1) tests/distributed/test_mics.py: mics_shard_size 2 (2 groups x 2) equals single-process fp64 PyTorch within
#    1e-5, hierarchical gather bit-equal to flat, shard size 4 with 2 "nodes" of 2 bit-equal to plain ZeRO-3, the
#    MiCS-layout checkpoint resumes exactly and reshards into plain ZeRO-3;
# 2) benchmarks/mics.py: same losses as plain ZeRO-3 (1e-4), bytes between the 2-GPU blocks counted, step time.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4 | sort | uniq -c
DSC_TEST_BACKEND=nccl timeout 80 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_mics.py 2>&1 | tail -4
timeout 65 python3 benchmarks/mics.py --nprocs 4 --shard 2 --backend nccl --layers 8 --d 1024 --vocab 8192 \
  --seq 512 --micro 4 --gas 2 --warmup 2 --steps 5 >/tmp/mics46.log 2>&1
rc=$?
grep -v "INFO\|^\s\|^)\|Parameter Group\|Warning" /tmp/mics46.log
[ "$rc" -ne 0 ] && { echo "exit $rc; last lines unfiltered:"; tail -25 /tmp/mics46.log; }
exit 0
