#!/usr/bin/env bash
# needs 1 GPU, ~5 min. Session 9, issue 39: BERT-large injected encoder, ours vs HF eager / sdpa vs the real
# DeepSpeed 0.19.8's injected BERT (fp16, batch 8 x 128, padding), with the device's transformers 5 and then
# with transformers 4.35 (.whl_tf4, DeepSpeed's injection policies' era).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
FILTER="INFO|WARNING|Warning|warn|^\s*$"
export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="transformer_inference"
source scripts/device_deepspeed.sh > $O/dsinst.txt 2>&1; tail -3 $O/dsinst.txt
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
python3 -m pip install -q --no-deps --no-index --target /tmp/tf4 .whl_tf4/*.whl .whl_tf4/extra/*.whl > /dev/null 2>&1
echo "== transformers 5 $(date +%T)"
timeout 200 python3 benchmarks/inference_rest.py bert --reps 7 2>&1 | grep -vE "$FILTER" > $O/bert5.txt; tail -9 $O/bert5.txt
echo "== transformers 4.35 $(date +%T)"
PYTHONPATH=/tmp/tf4:$PYTHONPATH timeout 200 python3 benchmarks/inference_rest.py bert --reps 7 2>&1 \
    | grep -vE "$FILTER" > $O/bert4.txt; tail -9 $O/bert4.txt
