#!/usr/bin/env bash
# 4 GPUs, <= 280 s: issue 50 — benchmarks/deepcompile.py, GPT 1.3B (d 2048, 24 layers, vocab 50304), seq 2048, micro 1,
# bf16 ZeRO-3 on 4 GPUs. A: our eager ZeRO-3 vs our DeepCompile ZeRO-3 (the 1.15x bar; dsc-dc-nb = without the
# forward/backward boundary keep+prefetch, A/B) and FSDP2 + torch.compile; B: vs DeepSpeed 0.19.8's DeepCompile
# (and eager). Compile time and peak memory in every table.
# DeepSpeed's fused_adam and DeepCompile (dc) ops are JIT-built in the background while A runs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d /tmp/ds_real/deepspeed ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
export TORCH_CUDA_ARCH_LIST=9.0  # DeepSpeed's op builder cannot parse "9.0a"
T0=$(date +%s)
left() { echo $(( 275 - ($(date +%s) - T0) )); }
BUILD=/tmp/ds_build_50.log
( for op in fused_adam dc; do python3 -c "from deepspeed.ops.op_builder.all_ops import ALL_OPS; ALL_OPS['$op'].load()" \
      >>$BUILD 2>&1 && echo "DeepSpeed op $op ready $(( $(date +%s) - T0 )) s" || echo "DeepSpeed op $op did not build"; done ) &
BPID=$!
run() {  # engines, time limit
    timeout "$2" python3 -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/deepcompile.py \
        --engines "$1" --check 2 --blocks 3 --steps 4 2>&1 | grep -vE "INFO|WARNING|Warning|warn\(|^\s*$|^\[rank|^W[0-9]{4}" | tail -18
}
echo "== A: dsc-eager,dsc-dc,dsc-dc-nb,fsdp2-tc $(date +%T)"
run dsc-eager,dsc-dc,dsc-dc-nb,fsdp2-tc 170
wait $BPID; tail -3 $BUILD | grep -iE "error|fail" ; L=$(left)
echo "== B: dsc-eager,ds-dc,ds-eager $(date +%T) (${L} s left)"
[ "$L" -gt 50 ] && run dsc-eager,ds-dc,ds-eager "$L"
echo "== done $(( $(date +%s) - T0 )) s"
