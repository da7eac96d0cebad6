#!/usr/bin/env bash
# Issue 42 (needs 1 GPU): random-LTD gather/scatter CUDA kernels bit-equal to the C reference and torch, their
# bandwidth at 2^26 elements against copy_ (bar >= 85%) and torch.gather/scatter; then a short random-LTD vs
# dense GPT run (24 layers, d 1024, seq 2048, bf16, interleaved steps): wall-time ratio and losses.
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
python3 -c "from op_builder.random_ltd import RandomLTDBuilder, RandomLTDCUDABuilder as C; RandomLTDBuilder().load(); C().load()" \
    2>&1 | tail -3
timeout 40 python3 benchmarks/data_efficiency.py kernels 2>&1 | grep -vE "INFO|Warning|warn\(" | tail -8
for sps in 256 16; do
timeout 60 python3 benchmarks/data_efficiency.py train --layers 24 --seq 2048 --d 1024 --micro 4 --steps 60 \
    --warmup 5 --seq_per_step $sps 2>&1 | grep -vE "INFO|Warning|warn\(" | tail -5
done
