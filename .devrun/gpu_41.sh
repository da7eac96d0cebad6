#!/usr/bin/env bash
# Needs 1 GPU. Issue 41: DS4Sci EvoformerAttention and DeepSpeedTransformerLayer on the GPU:
# builds the two CUDA ops (in parallel), then each benchmark's correctness table (fp16/bf16 kernels
# vs float32 references: outputs and all gradients, incl. the pair bias; memory flags on vs off)
# followed by its SMALL timings (ours vs naive / SDPA+bias / FlexAttention; ours vs HF BertLayer)
# and activation memory. Run from the repo root after `source scripts/device_setup.sh`. ~110 s.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
echo "== build evoformer_attn + transformer ops $(date +%T)"
python3 -c "from op_builder.evoformer_attn import EvoformerAttnBuilder as B; B().load(verbose=True)" 2>&1 | tail -3 &
python3 -c "from op_builder.transformer import TransformerBuilder as B; B().load(verbose=True)" 2>&1 | tail -3 &
wait
echo "== evoformer (built after $(( $(date +%s) - t0 )) s) $(date +%T)"
timeout "$(left 75)" python3 benchmarks/evoformer.py --small 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn"
echo "== transformer kernel $(date +%T)"
compile=--no-compile
if [ "$(left 118)" -gt 60 ]; then compile=""; fi  # HF torch.compile only when its compile time fits
timeout "$(left 118)" python3 benchmarks/transformer_kernel.py --small $compile 2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn"
echo "== done after $(( $(date +%s) - t0 )) s"
