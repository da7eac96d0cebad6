#!/usr/bin/env bash
# 4 GPUs, <= 200 s: issue 54 — benchmarks/megatron_3d.py, deepspeed_c vs the real DeepSpeed 0.19.8 in the same ranks,
# bf16: 3D PP 2 x TP 2 x DP 1 (ZeRO-1, PipelineModule, tied embedding), then TP 2 x DP 2 (ZeRO-1, initialize(mpu=)).
# Every step's loss side by side, tokens/s, ratio. Run from the repo root after `source scripts/device_setup.sh`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d /tmp/ds_real/deepspeed ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's op builder cannot parse "9.0a" (call 1 died on it)
T0=$(date +%s)
left() { echo $(( 195 - ($(date +%s) - T0) )); }
# DeepSpeed's FusedAdam is JIT-built on first use (~1 min): use it when already built, else torch Adam on both sides
ADAM=--torch_adam
ls ${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/*/fused_adam/fused_adam*.so >/dev/null 2>&1 && ADAM=
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader | head -4
SIZE="--hidden 4096 --heads 32 --layers 8 --vocab 32768 --seq 1024"
echo "== 3d pp2 tp2 dp1 zero1 micro 2 gas 8 ${ADAM:-fused adam} $(date +%T)"
timeout 115 python3 benchmarks/megatron_3d.py --layout 3d --pp 2 --tp 2 --dp 1 --stage 1 $SIZE --micro 2 --gas 8 \
    --check 3 --blocks 4 --steps 4 $ADAM 2>&1 | grep -vE "INFO|WARNING|UserWarning|^\s*$|^stage=|^ +[0-9]+: |^  loss: " | tail -30
L=$(left)
echo "== tp-dp tp2 dp2 zero1 micro 4 layers 4 (each rank builds the whole model on the host first) ${ADAM:-fused adam} $(date +%T) (${L} s left)"
[ "$L" -gt 40 ] && timeout "$L" python3 benchmarks/megatron_3d.py --layout tp-dp --tp 2 --dp 2 --stage 1 $SIZE --micro 4 --layers 4 \
    --check 3 --blocks 4 --steps 4 $ADAM 2>&1 | grep -vE "INFO|WARNING|UserWarning|^\s*$" | tail -28
echo "== done $(( $(date +%s) - T0 )) s"
