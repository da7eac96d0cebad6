#!/usr/bin/env bash
# needs 1 GPU. Issue 39 (inference, the rest), part 1 of 2 (part 2: gpu_39b.sh), <= 120 s incl. the op build:
# (1) weight-only int8/int4 quant_gemv/dequantize kernels vs the torch reference, then int8/int4 vs bf16 decode at
# batch 1 on a kernel-injected LLaMA (hidden 4096, 8 layers, group 128, CUDA graphs); (2) BERT-large-shaped masked
# LM (24 layers, batch 8 x 128, fp16, padding): injected encoder vs HF eager/sdpa.
# Session 3 (2xH200): quant ran (kernels correct; int8 0.88x, int4 0.86x of bf16 decode); bert was cut at 12 s.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
F="INFO|Warning|warn\(|UserWarning|^\s*$"
S=$(date +%s)
timeout 40 python3 -c "from deepspeed_c.ops.op_builder import InferenceBuilder as B; B().load()" 2>&1 | tail -3
echo "op build: $(( $(date +%s) - S )) s"
timeout 45 python3 benchmarks/inference_rest.py quant --hidden 4096 --layers 8 --new 32 --reps 3 2>&1 | grep -vE "$F"
timeout 40 python3 benchmarks/inference_rest.py bert --bert-layers 24 --batch 8 --seq 128 --reps 5 2>&1 | grep -vE "$F"
echo "total: $(( $(date +%s) - S )) s"
