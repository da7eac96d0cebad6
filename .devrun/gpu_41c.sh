#!/usr/bin/env bash
# Needs 1 GPU, <= 150 s including the op builds. Issue 41 (c): both bars at full size. Builds the two
# ops (in parallel); Evoformer B=1 N=128 L=512 H=4 D=32 in bf16 AND fp16 (correctness table first,
# then fwd+bwd / fwd time and peak memory: ours vs naive vs SDPA with the materialised bias vs
# FlexAttention, 10 interleaved reps); then DeepSpeedTransformerLayer against HF BertLayer (SDPA and
# eager attention) on the issue's sizes: 24 BERT-Large layers, seq 128 x batch 64 and seq 512 x
# batch 16, bf16, correctness table first (no torch.compile competitor: its 24-layer compile does not
# fit). Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
quiet() { grep -vE "^\s*$|UserWarning|warnings.warn|_warn_once"; }
stage() {  # stage NAME DEADLINE_S MIN_S CMD...: runs CMD if at least MIN_S seconds remain before DEADLINE_S
    local name=$1 deadline=$2 min=$3; shift 3
    if [ "$(left "$deadline")" -lt "$min" ]; then echo "== $name: skipped (out of time)"; return; fi
    echo "== $name $(date +%T)"
    timeout "$(left "$deadline")" "$@" 2>&1 | quiet
}
echo "== build evoformer_attn + transformer ops $(date +%T)"
python3 -c "from op_builder.evoformer_attn import EvoformerAttnBuilder as B; B().load(verbose=True)" 2>&1 | tail -2 &
python3 -c "from op_builder.transformer import TransformerBuilder as B; B().load(verbose=True)" 2>&1 | tail -2 &
wait
stage "evoformer bf16 + fp16 (ops built after $(( $(date +%s) - t0 )) s)" 80 25 \
    python3 benchmarks/evoformer.py --reps 10 --only naive,sdpa,flex
stage "transformer layer, 24 layers, seq 128 and 512" 147 30 \
    python3 benchmarks/transformer_kernel.py --layers 24 --reps 5 --no-compile --no-memory
echo "== done after $(( $(date +%s) - t0 )) s"
