#!/usr/bin/env bash
# Needs 1 GPU, <= 150 s including the op build. Issue 41 (b): DS4Sci EvoformerAttention on mma.sync
# tensor-core tiles (replacing the WMMA ones). Builds the op; correctness of the kernels against
# float32 naive math (outputs and all gradients incl. both biases; odd shapes, D 8/12/16/32/64,
# no-bias and mask-only cases, the benchmark shape); then B=1 N=128 L=512 H=4 D=32 bf16 fwd+bwd and
# fwd time, interleaved: ours vs SDPA with the materialised bias vs FlexAttention (score_mod), with
# peak memory; our kernels' profile (torch.profiler); then the cold build of the op on
# 2 cores (taskset -c 0,1: the #43 bar is a 2-core machine); then, as time allows, the per-kernel
# time of a BERT-Large 2-layer training step (ours, HF SDPA, HF eager). Run from the repo root after
# `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
quiet() { grep -vE "^\s*$|UserWarning|warnings.warn"; }
echo "== build evoformer_attn $(date +%T)"
python3 -c "from op_builder.evoformer_attn import EvoformerAttnBuilder as B; B().load(verbose=True)" 2>&1 | tail -3
echo "== evoformer (op built after $(( $(date +%s) - t0 )) s) $(date +%T)"
timeout "$(left 95)" python3 benchmarks/evoformer.py --small --only naive,sdpa,flex --profile 2>&1 \
    | quiet
stage() {  # stage NAME DEADLINE_S MIN_S CMD...: runs CMD if at least MIN_S seconds remain before DEADLINE_S
    local name=$1 deadline=$2 min=$3; shift 3
    if [ "$(left "$deadline")" -lt "$min" ]; then echo "== $name: skipped (out of time)"; return; fi
    echo "== $name $(date +%T)"
    timeout "$(left "$deadline")" "$@" 2>&1 | quiet
}
pin=""; command -v taskset >/dev/null && pin="taskset -c 0,1"
stage "cold build of evoformer_attn pinned to 2 cores ($pin)" 118 15 \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $pin python3 benchmarks/build_time.py --ops evoformer_attn --skip-torch
stage "transformer layer: per-kernel time of a step (ours, HF SDPA, HF eager)" 148 25 \
    python3 benchmarks/transformer_kernel.py --profile-only
echo "== done after $(( $(date +%s) - t0 )) s"
