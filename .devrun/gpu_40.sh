#!/usr/bin/env bash
# needs 1 GPU. Issue 40 (long context) short check, ~110 s: (1) FPDT_Attention fp32 parity at 4K (CUDA offload path,
# 1e-5), then bf16 parity vs the unchunked Ulysses layer (both against fp32, 8B attention shape, 16K tokens,
# 4 chunks, offload on/off; DeepSpeed's FPDT too if flash-attn is installed) + fwd+bwd timings;
# (2) ALST one-step search on a 2-layer LLaMA-8B-shaped model (vocab 128256) at 64K -> 128K tokens,
# deepspeed_c then the real DeepSpeed 0.19.8 in the same process (client torch AdamW for both: no CPU-Adam JIT);
# (3) FPDT mode (deepspeed_c) on the same 2-layer shape (vocab 32000) at 64K -> 128K on one GPU.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
if [ -d /tmp/ds_real/deepspeed ]; then DSREADY=1; else
  (bash -c 'source scripts/device_deepspeed.sh' >/tmp/ds40_install.log 2>&1) & DSPID=$!; DSREADY=0; fi
echo "== (1) FPDT layer parity (bf16 vs unchunked Ulysses, fp32 reference) =="
timeout 25 python3 benchmarks/long_context.py --mode parity --parity-seq 16384 --reps 3 2>&1 | grep -v "INFO\|Warning\|warn("
[ "$DSREADY" = 0 ] && { wait $DSPID || tail -5 /tmp/ds40_install.log; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
case "${TORCH_CUDA_ARCH_LIST:-}" in *a*) export TORCH_CUDA_ARCH_LIST=9.0 ;; esac
echo "== (2) ALST largest sequence, 2-layer 8B shape, 1 GPU, dsc vs DeepSpeed =="
T=$(( 97 - SECONDS )); [ $T -gt 68 ] && T=68
timeout $T python3 benchmarks/long_context.py --mode alst --impls dsc,ds --layers 2 --start-seq 65536 \
  --max-seq 131072 --optimizer torch --time-limit 20 2>&1 | grep -v "INFO\|Warning\|warn(\|^ \|Parameter\|^))"
echo "== (3) FPDT mode, 2-layer 8B shape but vocab 32000 (short setup), 1 GPU (chunk 32K, offload on) =="
T=$(( 117 - SECONDS )); [ $T -lt 12 ] && { echo "skipped: ${SECONDS}s used of 120"; exit 0; }
timeout $T python3 benchmarks/long_context.py --mode fpdt --impls dsc --layers 2 --vocab 32000 --start-seq 65536 \
  --max-seq 131072 --chunk 32768 --optimizer own --time-limit 8 2>&1 | grep -v "INFO\|Warning\|warn(\|^ \|Parameter\|^))"
