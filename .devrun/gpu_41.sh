#!/usr/bin/env bash
# Needs 1 GPU. Issue 41: DS4Sci EvoformerAttention and DeepSpeedTransformerLayer on the GPU:
# builds the two CUDA ops (in parallel); each benchmark's correctness table (fp16/bf16 kernels vs
# float32 references: outputs and all gradients incl. the pair bias; memory flags on vs off) and its
# SMALL timings (ours vs naive / SDPA+bias; ours vs HF BertLayer) and activation memory; then, as
# far as the 120 s allow, the torch.compile competitors (FlexAttention score_mod, HF under
# torch.compile). Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
quiet() { grep -vE "^\s*$|UserWarning|warnings.warn"; }
echo "== build evoformer_attn + transformer ops $(date +%T)"
python3 -c "from op_builder.evoformer_attn import EvoformerAttnBuilder as B; B().load(verbose=True)" 2>&1 | tail -3 &
python3 -c "from op_builder.transformer import TransformerBuilder as B; B().load(verbose=True)" 2>&1 | tail -3 &
wait
echo "== evoformer (ops built after $(( $(date +%s) - t0 )) s) $(date +%T)"
timeout "$(left 75)" python3 benchmarks/evoformer.py --small --no-flex 2>&1 | quiet
echo "== transformer kernel $(date +%T)"
timeout "$(left 100)" python3 benchmarks/transformer_kernel.py --small --no-compile 2>&1 | quiet
stage() {  # stage NAME DEADLINE_S MIN_S CMD...: runs CMD if at least MIN_S seconds remain before DEADLINE_S
    local name=$1 deadline=$2 min=$3; shift 3
    if [ "$(left "$deadline")" -lt "$min" ]; then echo "== $name: skipped (out of time)"; return; fi
    echo "== $name $(date +%T)"
    timeout "$(left "$deadline")" "$@" 2>&1 | quiet
}
stage "FlexAttention (torch.compile)" 112 20 python3 benchmarks/evoformer.py --small --skip-check --only flex
stage "HF BertLayer under torch.compile" 119 25 python3 benchmarks/transformer_kernel.py --small --skip-check --no-memory
echo "== done after $(( $(date +%s) - t0 )) s"
