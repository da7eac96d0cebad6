#!/usr/bin/env bash
# Needs 1 GPU, <= 150 s including the op build. Issue 41 (c): the transformer layer's fused kernels
# rewritten (16-byte vectorised chunks, fp32 math, a row in registers, two-stage column sums, the
# bias gradients fused into gelu_backward / norm_backward). In order:
#   1. kernels: each piece on the GPU against its torch form (fused_reference, float32 math): the
#      vectorised and the fallback paths, fp32/fp16/bf16; then per call at BERT-Large shapes
#      (T = 64 x 128 rows), GPU kernel time (torch.profiler) and wall time, beside torch's kernels
#      for the same work ("x ours" = their time / ours: above 1, ours is faster);
#   2. the layer against HF BertLayer (outputs and all gradients, fp16/bf16 vs float32, pre/post-LN,
#      SDPA and softmax cores, masks, odd lengths; memory flags on vs off);
#   3. the per-kernel profile of a 2-layer training step: ours vs HF (SDPA) vs HF eager attention;
#   4. training step time, 8 BERT-Large layers, seq 128 (batch 64) and 512 (batch 16), bf16,
#      dropout 0.1: ours vs HF eager (SDPA attention: "hf"; eager attention: "hf-eager-attn");
#   5. the same vs HF under torch.compile ("hf-compile", each layer compiled; a background process
#      started at t=0 fills torch.compile's caches so this stage times rather than compiles).
# Run from the repo root after `source scripts/device_setup.sh`.
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
warm_log=$(mktemp)
timeout 105 python3 benchmarks/transformer_kernel.py --compile-warmup --seqs 128,512 >"$warm_log" 2>&1 &
warm=$!
echo "== build transformer op $(date +%T)"
python3 -c "from op_builder.transformer import TransformerBuilder as B; B().load(verbose=True)" 2>&1 | tail -2
stage "1. kernels vs fused_reference, then vs torch's kernels (op built after $(( $(date +%s) - t0 )) s)" 40 10 \
    python3 benchmarks/transformer_pieces.py --reps 5 --inner 20
stage "2. layer vs HF BertLayer" 70 12 python3 benchmarks/transformer_kernel.py --check-only
stage "3. per-kernel profile of a step (2 layers, 64 x 128)" 84 8 python3 benchmarks/transformer_kernel.py --profile-only
stage "4. step time vs HF eager" 108 12 \
    python3 benchmarks/transformer_kernel.py --skip-check --no-memory --no-compile --layers 8 --reps 7 \
    --systems hf,hf-eager-attn
if [ "$(left 110)" -gt 0 ]; then wait "$warm" 2>/dev/null; fi
echo "== compile warm-up: $(tail -1 "$warm_log" | cut -c1-200)"
stage "5. step time vs HF under torch.compile" 148 15 \
    python3 benchmarks/transformer_kernel.py --skip-check --no-memory --layers 8 --reps 7 --systems hf,hf-compile
echo "== done after $(( $(date +%s) - t0 )) s"
