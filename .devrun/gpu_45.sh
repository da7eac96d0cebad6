#!/usr/bin/env bash
# Needs 1 GPU, <= 150 s including the sparse_attn op build. Issue 45: block-sparse attention.
# Builds op sparse_attn, then benchmarks/sparse_attention.py: the correctness table first (our
# fp16/bf16 kernels vs float32 dense masked math: out, dq, dk, dv for every config family, blocks
# 16-128, head dims 32/64/128, masks and rpe), then fwd+bwd timings at seq 16k then 4k (Fixed and
# BigBird ~10% dense, block 64, 16 heads, D 64, bf16): ours vs FlexAttention (same BlockMask,
# torch.compile'd) vs dense flash SDPA, interleaved reps, ratios and peak memory. Both kernel
# 'ours' = the fused kernels (cp.async + ldmatrix; the simple form was removed in session 5).
# Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
echo "== build sparse_attn $(date +%T)"
timeout 110 python3 -c "from op_builder.sparse_attn import SparseAttnBuilder as B; B().load(verbose=True)" 2>&1 | tail -3
echo "== benchmark (op built after $(( $(date +%s) - t0 )) s) $(date +%T)"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout "$(left 118)" python3 benchmarks/sparse_attention.py --quick-check --seqs 16384,4096 --reps 5 --no-masked \
    2>&1 | grep -vE "^\s*$|UserWarning|warnings.warn|Consider using tensor.detach|return float"
if [ "$(left 150)" -gt 25 ]; then
    echo "== BERT flow, seq 4096, 50 steps $(date +%T)"
    timeout "$(left 148)" python3 benchmarks/sparse_attention.py --only-bert --bert-steps 50 --bert-seq 4096 2>&1 \
        | grep -vE "^\s*$|UserWarning|warnings.warn"
fi
echo "== done after $(( $(date +%s) - t0 )) s"
