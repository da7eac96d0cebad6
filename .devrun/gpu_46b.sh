#!/usr/bin/env bash
# needs 4 GPUs, <= 150 s. Issue 46 (MiCS): tests/distributed/test_mics.py with one GPU a rank (NCCL): mics_shard_size
# 2 (2 groups x 2) equals single-process fp64 PyTorch within 1e-5, hierarchical gather bit-equal to flat, shard
# size 4 with 2 "nodes" of 2 bit-equal to plain ZeRO-3, checkpoint in DeepSpeed's MiCS layout resumes exactly and
# reshards into plain ZeRO-3. Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4 | sort | uniq -c
DSC_TEST_BACKEND=nccl timeout 140 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_mics.py 2>&1 | tail -6
