#!/usr/bin/env bash
# needs 2 GPUs (the tp section; the rest runs on 1). Issue 39 (inference, the rest), <= 120 s incl. the
# transformer_inference op build: (1) weight-only int8/int4 quant_gemv/dequantize kernels vs the torch reference,
# then int8/int4 vs bf16 decode at batch 1 on a kernel-injected LLaMA (hidden 4096, 8 layers, group 128, CUDA graphs);
# (2) BERT-large-shaped masked LM (24 layers, batch 8 x 128, fp16, padding): injected encoder vs HF eager/sdpa;
# (3) ZeRO-Inference offload_param cpu (LLaMA hidden 2048 x 8 layers, bf16): ours vs the real DeepSpeed 0.19.8
# ZeRO-3 param offload (deepspeed.initialize) vs HF fully on the GPU; (4) injected TP2 vs TP1 decode (2 GPUs).
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -2
if [ -d /tmp/ds_real/deepspeed ]; then DSREADY=1; else
  (bash -c 'source scripts/device_deepspeed.sh' >/tmp/ds39_install.log 2>&1) & DSPID=$!; DSREADY=0; fi
F="INFO|Warning|warn\(|UserWarning|^\s*$"
S=$(date +%s)
timeout 40 python3 -c "from deepspeed_c.ops.op_builder import InferenceBuilder as B; B().load()" 2>&1 | tail -3
echo "op build: $(( $(date +%s) - S )) s"
timeout 20 python3 benchmarks/inference_rest.py quant --hidden 4096 --layers 8 --new 32 --reps 3 2>&1 | grep -vE "$F"
timeout 12 python3 benchmarks/inference_rest.py bert --bert-layers 24 --batch 8 --seq 128 --reps 5 2>&1 | grep -vE "$F"
[ "$DSREADY" = 0 ] && { wait $DSPID || tail -5 /tmp/ds39_install.log; }
case "${TORCH_CUDA_ARCH_LIST:-}" in *a*) export TORCH_CUDA_ARCH_LIST=9.0 ;; esac
PYTHONPATH=/tmp/ds_real${PYTHONPATH:+:$PYTHONPATH} timeout 28 python3 benchmarks/inference_rest.py zero \
  --zero-hidden 2048 --zero-layers 8 --new 8 --reps 2 2>&1 | grep -vE "$F|^\[|ds_accelerator|Stage 3|DeepSpeed"
timeout 18 python3 benchmarks/inference_rest.py tp --hidden 4096 --layers 4 --new 32 --reps 3 2>&1 | grep -vE "$F"
echo "total: $(( $(date +%s) - S )) s"
