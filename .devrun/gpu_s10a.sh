#!/usr/bin/env bash
# needs 1 GPU, ~3 min. Session 10: the transformer layer's kernel path under autograd.grad / inputs= / accumulation /
# create_graph / torch.func, plus the layer's other GPU tests (regressions of the create_graph change).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
timeout 400 python3 -m pytest -q -p no:cacheprovider -rs ${TESTS:-tests/unit/test_transformer_layer_autograd_cuda.py \
    tests/unit/test_transformer_layer_cuda.py tests/unit/test_transformer_kernels_cuda.py \
    tests/unit/test_transformer_layer_higher_order.py} > $O/tests.txt 2>&1
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $O/tests.txt | head -40
