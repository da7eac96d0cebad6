# needs 1 GPU, ~1 min
# Session 10: the GPU paths of the custom autograd Functions (DS4Sci evoformer and sparse attention CUDA kernels in
# bf16 and fp16, the MoE gating op, the random-LTD token kernels, TiledMLP / TiledFusedLogitsLoss /
# sequence_tiled_compute / FPDT_FFN on cuda) under autograd.grad, backward(inputs=), create_graph penalties,
# torch.func grad / vmap(grad) and accumulation, against float64 references on the GPU
# (tests/unit/test_autograd_paths_cuda.py). The four ops build first, side by side (cold: ~10-20 s), so the
# test's own time (--durations) stays apart from the builds.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
timeout 240 python3 - <<'PY' 2>&1 | grep -v -i "warn" | tail -6
import time
from concurrent.futures import ThreadPoolExecutor

from deepspeed_c.ops.op_builder import EvoformerAttnBuilder, MoEGatingCUDABuilder, RandomLTDCUDABuilder
from op_builder.sparse_attn import SparseAttnBuilder


def build(cls):
    t = time.time()
    try:
        cls().load()
        return f"built {cls.NAME} in {time.time() - t:.1f}s"
    except Exception as err:  # the test then fails naming the op; say why here
        return f"build of {cls.NAME} failed: {err}"


with ThreadPoolExecutor(4) as pool:
    for line in pool.map(build, (EvoformerAttnBuilder, SparseAttnBuilder, MoEGatingCUDABuilder, RandomLTDCUDABuilder)):
        print(line)
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --durations=6 tests/unit/test_autograd_paths_cuda.py \
    > $OUT/autograd_cuda.txt 2>&1; grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/autograd_cuda.txt | head -40
grep -E "^[0-9.]+s (call|setup)" $OUT/autograd_cuda.txt | head -6
