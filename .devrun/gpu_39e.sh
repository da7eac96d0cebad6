#!/usr/bin/env bash
# needs 2 GPUs, <= 150 s incl. the op build. Issue 39, session 7: kernel injection at tp_size 2 vs 1, batch-1 decode,
# 7B-shaped LLaMA (hidden 4096 x 32 layers, random weights, bf16) then the 4-layer model of 39d. init_inference now
# takes enable_cuda_graph with tp_size 2 (the decode step and its 2 all-reduces per block captured, NCCL):
# the tp2 row is graphs, tp2-eager the same engine with graphs off. Per model: logits vs HF fp32 (prefill + 7
# teacher-forced decode steps, tolerance 3x HF bf16's own error), then decode ms/token tp1 / tp1-eager / tp2-eager /
# tp2 with the ratio to tp1 (graphs), then the breakdown (one decode step's host enqueue and wall ms; one
# all-reduce of [1 x 4096] eager and in a graph, us/call).
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
nvidia-smi topo -m 2>/dev/null | head -3
F="INFO|Warning|warn\(|UserWarning|^\s*$"
S=$(date +%s)
timeout 60 python3 -c "
import torch
from deepspeed_c.ops.op_builder import InferenceBuilder as B
B().load()
print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'p2p 0<->1', torch.cuda.can_device_access_peer(0, 1))
" 2>&1 | tail -3
echo "op build: $(( $(date +%s) - S )) s"
LEFT=$(( 145 - ($(date +%s) - S) ))
timeout "$LEFT" python3 benchmarks/inference_tp.py --hidden 4096 --layers 32,4 --new 32 --reps 3 2>&1 | grep -vE "$F"
echo "total: $(( $(date +%s) - S )) s"
