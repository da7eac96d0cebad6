#!/usr/bin/env bash
# needs 1 GPU, <= 150 s. Issue 41: DeepSpeed 0.19.8's own kernels side by side (the bar asks for them "if they build,
# else the build error verbatim"): its transformer op (JIT, DS_PREBUILD) and its CUTLASS Evoformer op. Then our
# layer vs DeepSpeed's DeepSpeedTransformerLayer and HF (8 BERT-Large layers, seq 128, bf16), and our Evoformer vs
# DeepSpeed's; the activation-memory table of the memory flags (ours). Carry .dsref (DeepSpeed sdist).
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
quiet() { grep -vE "^\s*$|UserWarning|warnings.warn|_warn_once"; }
echo "== DeepSpeed install + its transformer op build $(date +%T)"
export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="transformer"
timeout 110 bash -c 'source scripts/device_deepspeed.sh' 2>&1 | tail -6
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
echo "== DeepSpeed evoformer_attn build (CUTLASS) after $(( $(date +%s) - t0 )) s"
timeout "$(left 100)" python3 -c "from deepspeed.ops.op_builder.all_ops import ALL_OPS; ALL_OPS['evoformer_attn'].load()" \
    2>&1 | grep -vE "^\s*$" | tail -4
echo "== layer: ours vs DeepSpeed's kernel vs HF (8 layers) after $(( $(date +%s) - t0 )) s"
timeout "$(left 135)" python3 benchmarks/transformer_kernel.py --skip-check --no-compile --layers 8 --reps 7 \
    --seqs 128 --systems hf,deepspeed --deepspeed --dtype fp16 2>&1 | quiet | tail -22
echo "== evoformer: ours vs DeepSpeed's after $(( $(date +%s) - t0 )) s"
[ "$(left 148)" -gt 12 ] && timeout "$(left 148)" python3 benchmarks/evoformer.py --small --only sdpa,deepspeed 2>&1 \
    | quiet | tail -8
echo "== done after $(( $(date +%s) - t0 )) s"
