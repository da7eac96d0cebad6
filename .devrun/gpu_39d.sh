#!/usr/bin/env bash
# needs 2 GPUs, <= 150 s incl. the op build. Issue 39, session 4: kernel injection at tp_size 2 vs 1 with CUDA
# graphs on both sides (TP2's NCCL all-reduces captured in the decode graph; call 1 of this session ran both
# without graphs: TP2 0.58x of TP1, launch-bound), plus TP2 without graphs; LLaMA hidden 4096 x 4 layers, batch 1.
# Correctness first: TP2 prefill logits vs TP1, TP2 (graph) greedy tokens vs TP1's.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
F="INFO|Warning|warn\(|UserWarning|^\s*$"
S=$(date +%s)
timeout 60 python3 -c "from deepspeed_c.ops.op_builder import InferenceBuilder as B; B().load()" 2>&1 | tail -3
echo "op build: $(( $(date +%s) - S )) s"
LEFT=$(( 145 - ($(date +%s) - S) ))
timeout "$LEFT" python3 benchmarks/inference_rest.py tp --hidden 4096 --layers 4 --new 32 --reps 3 2>&1 | grep -vE "$F"
echo "total: $(( $(date +%s) - S )) s"
