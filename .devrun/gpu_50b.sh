#!/usr/bin/env bash
# 4 GPUs, <= 150 s: issue 50, last call. A: GPT 2.7B (d 2560, 32 layers), seq 2048, micro 1, bf16 ZeRO-3: our eager vs
# our DeepCompile (the current pass: unit kept/prefetched across forward->backward, reduce-scatters tied in place).
# B (time left): DeepSpeed 0.19.8's DeepCompile alone at 1.3B (call 4's dsc-dc: 75.4 ms/step), with its traceback if it
# dies (call 4's B died with rank exit 1, error filtered away).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d /tmp/ds_real/deepspeed ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
export TORCH_CUDA_ARCH_LIST=9.0
T0=$(date +%s)
left() { echo $(( 145 - ($(date +%s) - T0) )); }
( python3 -c "from deepspeed.ops.op_builder.all_ops import ALL_OPS; ALL_OPS['dc'].load()" >/tmp/ds_dc_build.log 2>&1 \
    || echo "DeepSpeed op dc did not build" ) &
run() {  # engines, time limit, tag, extra args
    timeout "$2" python3 -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/deepcompile.py \
        --engines "$1" --check 2 --blocks 3 --steps 3 $4 > /tmp/dc_$3.log 2>&1
    echo "   (exit $?)"
    grep -E "^   |^engine|^dsc|^ds-|^fsdp|^GPU" /tmp/dc_$3.log | grep -vE "Group|betas|bias_corr|eps:|lr:|weight_decay" | tail -12
    grep -q Traceback /tmp/dc_$3.log && grep -m1 -A45 "Traceback" /tmp/dc_$3.log | grep -vE "^\s*[~^]+\s*$" | head -50
}
echo "== A: 2.7B dsc-eager,dsc-dc $(date +%T)"
run dsc-eager,dsc-dc 125 a "--n_embd 2560 --n_layer 32 --n_head 32"
L=$(left)
echo "== B: 1.3B ds-dc $(date +%T) (${L} s left)"
[ "$L" -gt 25 ] && run ds-dc "$L" b ""
echo "== done $(( $(date +%s) - T0 )) s"
