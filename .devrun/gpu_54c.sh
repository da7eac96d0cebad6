#!/usr/bin/env bash
# 4 GPUs: issue 54 Deliver 3 — Megatron-DeepSpeed's own pretrain_gpt.py (a checkout outside the project)
# at PP 2 x TP 2 x DP 1, bf16, ZeRO-1, launched by `deepspeed` with the SAME flags twice: `import deepspeed`
# = deepspeed_c (the opt-in alias, compat/deepspeed) and = the real DeepSpeed 0.19.8. Prints each iteration's
# loss side by side (correctness first), then Megatron's tokens/s per GPU for both and the ratio.
#
# CARRY: .mds (the Megatron-DeepSpeed checkout .mds/Megatron-DeepSpeed, deepspeedai HEAD 4efb479, and its
# pure-Python deps .mds/deps: six, einops, pybind11) and .dsref (the DeepSpeed 0.19.8 sdist), plus .whl as
# usual: run(carry=[".mds", ".dsref", ".whl"]). Run from the repo root after `source scripts/device_setup.sh`.
#
# Then TP 2 x DP 2 at ZeRO-1 (--no-pipeline-parallel) when time is left.
# Two phases, so the timed part stays <= 150 s:
#   bash .devrun/gpu_54c.sh setup   # ~3-4 min once per machine: alias + real DeepSpeed install, DeepSpeed's
#                                   # fused_adam JIT, Megatron's dataset helper and (in a 1-iteration warm-up run
#                                   # with ours) the 3 fused-softmax CUDA kernels Megatron compiles on every CUDA
#                                   # start (unused here: --no-masked-softmax-fusion); all kept under /tmp
#   bash .devrun/gpu_54c.sh         # <= 150 s: the comparison (runs setup first when /tmp/mds_gpu is missing)
# Megatron-side workarounds (see benchmarks/megatron_client/run_pretrain_gpt.py): one attention head per tensor
# rank (its CoreAttention .view bug at this snapshot), apex / torchvision import stand-ins (shims/), an nvcc
# wrapper (its fused kernels ask for sm_70, which CUDA 13 dropped: built for sm_90 only), and an import-only
# deepspeed.compression.compress stub in a COPY of the real DeepSpeed (0.19.8 dropped it; Megatron imports it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
ROOT=$(pwd)
MDS=/tmp/mds_gpu
DEPS=$ROOT/.mds/deps
[ -d .mds/Megatron-DeepSpeed ] || { echo "missing .mds/Megatron-DeepSpeed: carry .mds"; exit 1; }
BASE_PYTHONPATH=${PYTHONPATH:-}

setup() {
    echo "== setup $(date +%T)"
    python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/dsc_alias ./compat/deepspeed \
        || { echo "alias install failed"; return 1; }
    # DeepSpeed's fused_adam is built under the same CUDA_HOME (the wrapper) the runs use, or its JIT would
    # see another nvcc path and rebuild inside the timed runs
    export TORCH_CUDA_ARCH_LIST=9.0 DS_PREBUILD="fused_adam"
    source scripts/device_deepspeed.sh
    export PYTHONPATH=$BASE_PYTHONPATH  # each run names its DeepSpeed itself
    [ -d /tmp/ds_real/deepspeed ] || { echo "real DeepSpeed not installed (carry .dsref)"; return 1; }
    # import-only stub in place (a copy would change its JIT sources' paths and rebuild fused_adam)
    python3 -c "import sys; sys.path.insert(0, 'benchmarks/megatron_client'); import run_pretrain_gpt as c; \
c.real_with_compress_stub('/tmp/ds_real', None)"
    [ -d $MDS ] || cp -r .mds/Megatron-DeepSpeed $MDS
    # Megatron's dataset helper: built here for this python (its Makefile asks python3-config, maybe absent)
    EXT=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    [ -f $MDS/megatron/data/helpers$EXT ] || g++ -O3 -shared -std=c++11 -fPIC \
        $(PYTHONPATH=$DEPS python3 -m pybind11 --includes) $MDS/megatron/data/helpers.cpp -o $MDS/megatron/data/helpers$EXT
    echo "== warm-up: 1 iteration with ours (Megatron compiles its fused kernels) $(date +%T)"
    timeout 400 python3 benchmarks/megatron_client/run_pretrain_gpt.py --mds $MDS \
        --launcher /tmp/dsc_alias/bin/deepspeed --pythonpath /tmp/dsc_alias:$DEPS --device cuda --gpus 4 \
        --tp 2 --pp 2 --iters 1 --tag warmup --work /tmp/mds_work_warm 2>&1 | tail -4
    echo "== setup done $(( $(date +%s) - T0 )) s"
}

make_nvcc_wrapper() {
    local real=${CUDA_HOME:-/usr/local/cuda}
    [ "$real" = /tmp/cuda_mds ] && real=/usr/local/cuda
    real=$(readlink -f "$real")
    mkdir -p /tmp/cuda_mds/bin
    for e in "$real"/*; do [ "$(basename "$e")" = bin ] || ln -sfn "$e" /tmp/cuda_mds/; done
    for e in "$real"/bin/*; do ln -sfn "$e" /tmp/cuda_mds/bin/; done
    rm -f /tmp/cuda_mds/bin/nvcc
    cat > /tmp/cuda_mds/bin/nvcc <<EOF
#!/usr/bin/env bash
# keeps only the sm_90 targets of a build (Megatron asks sm_70..sm_90; CUDA 13 has no sm_70)
args=(); take=0
for a in "\$@"; do
  if [ \$take = 1 ]; then take=0; case "\$a" in *compute_90*) args+=(-gencode "\$a");; esac; continue; fi
  case "\$a" in
    -gencode) take=1;;
    -gencode=*) case "\$a" in *compute_90*) args+=("\$a");; esac;;
    *) args+=("\$a");;
  esac
done
exec "$real/bin/nvcc" "\${args[@]}"
EOF
    chmod +x /tmp/cuda_mds/bin/nvcc
}

[ -x /tmp/cuda_mds/bin/nvcc ] || make_nvcc_wrapper
export CUDA_HOME=/tmp/cuda_mds
[ "${1:-}" = setup ] && { setup; exit $?; }
[ -d $MDS ] && [ -d /tmp/dsc_alias/deepspeed ] && [ -d /tmp/ds_real/deepspeed ] || setup || exit 1
export PYTHONPATH=$BASE_PYTHONPATH
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader | head -4
T1=$(date +%s)
echo "== pretrain_gpt.py PP 2 x TP 2 x DP 1, bf16, ZeRO-1, clipping off, layers 8 hidden 2048 seq 1024, micro 2 x gas 8 $(date +%T)"
timeout 140 python3 benchmarks/megatron_client/run_pretrain_gpt.py --mds $MDS \
    --alias /tmp/dsc_alias --real /tmp/ds_real --pythonpath $DEPS --device cuda --gpus 4 --tp 2 --pp 2 \
    --layers 8 --hidden 2048 --seq 1024 --micro 2 --global-batch 16 --iters 10 --stage 1 --clip 0 --bf16 \
    --work /tmp/mds_work 2>&1 | grep -vE "INFO|WARNING|UserWarning|^\s*$" | tail -20
L=$(( 148 - ($(date +%s) - T1) ))
echo "== TP 2 x DP 2 (its mpu through initialize, --no-pipeline-parallel), bf16, ZeRO-1, clipping 1.0 $(date +%T) (${L} s left)"
[ "$L" -gt 50 ] && timeout "$L" python3 benchmarks/megatron_client/run_pretrain_gpt.py --mds $MDS \
    --alias /tmp/dsc_alias --real /tmp/ds_real --pythonpath $DEPS --device cuda --gpus 4 --tp 2 --pp 1 \
    --layers 8 --hidden 2048 --seq 1024 --micro 2 --global-batch 16 --iters 10 --stage 1 --clip 1.0 --bf16 \
    --port 29621 --work /tmp/mds_work 2>&1 | grep -vE "INFO|WARNING|UserWarning|^\s*$" | tail -16
echo "== done: comparison $(( $(date +%s) - T1 )) s, total $(( $(date +%s) - T0 )) s"
for f in /tmp/mds_work/log_*.txt; do [ -f "$f" ] && { echo "-- $f (tail)"; grep -E "Error|error|Traceback" "$f" | tail -5; }; done
