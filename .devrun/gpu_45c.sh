#!/usr/bin/env bash
# Needs 1 GPU, <= 120 s including the sparse_attn op build. Issue 45, load balancing: the balanced grid
# (long block rows / columns split over several CTAs, partials merged by combine kernels, CTAs longest
# first; DSC_SPARSE_ATTN_BALANCE=1) against the old index-order grid ("ours-old"), FlexAttention (same
# block mask) and dense flash SDPA; fwd+bwd, B1 H16 D64 block 64 bf16, median of 5 interleaved reps.
# First the quick correctness table with the balanced grid on ('split' rows force one-block parts, so the
# split path and its combine kernels run on every shape); then seq 16384 Fixed and BigBird; then seq 32768
# BigBird (no flex, no check). Run from the repo root after `source scripts/device_setup.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1 DSC_SPARSE_ATTN_BALANCE=1
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
quiet() { grep -vE "^\s*$|UserWarning|warnings.warn|Consider using tensor.detach|return float"; }
echo "== build sparse_attn $(date +%T)"
timeout 100 python3 -c "from op_builder.sparse_attn import SparseAttnBuilder as B; B().load(verbose=True)" \
    2>&1 | tail -3
echo "== check + seq 16384 (op built after $(( $(date +%s) - t0 )) s) $(date +%T)"
timeout "$(left 95)" python3 benchmarks/sparse_attention.py --quick-check --seqs 16384 --reps 5 --no-masked \
    --balance both 2>&1 | quiet
echo "== seq 32768 bigbird $(date +%T)"
timeout "$(left 118)" python3 benchmarks/sparse_attention.py --skip-check --seqs 32768 --layouts bigbird --reps 5 \
    --no-masked --no-flex --balance both 2>&1 | quiet
echo "== done after $(( $(date +%s) - t0 )) s"
