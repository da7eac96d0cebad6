#!/usr/bin/env bash
# For a GPU machine without network: install the real DeepSpeed (the competitor in benchmarks/)
# from an sdist carried in .dsref/ (downloaded beforehand with
# `pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d .dsref`) into /tmp/ds_real, outside
# the project, with its ops left to its own JIT. Source it after scripts/device_setup.sh.
if ls .dsref/deepspeed-*.tar.gz >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/ds_real \
        .dsref/deepspeed-*.tar.gz >/tmp/ds_install.log 2>&1 || { tail -20 /tmp/ds_install.log; return 1 2>/dev/null || exit 1; }
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ds_real
    # DeepSpeed's op builder cannot parse arch suffixes such as "9.0a"
    case "${TORCH_CUDA_ARCH_LIST:-}" in *a*) export TORCH_CUDA_ARCH_LIST=9.0 ;; esac
fi
# DS_PREBUILD="fused_adam transformer_inference ...": JIT-build those ops of the real DeepSpeed now (cached
# under ~/.cache/torch_extensions), so a timed benchmark's limit is not spent compiling them (a 2-GPU
# parallel_throughput pipe/tp run was cut while DeepSpeed built its fused Adam). Failures only print.
for _ds_op in ${DS_PREBUILD:-}; do
    python3 -c "from deepspeed.ops.op_builder.all_ops import ALL_OPS; ALL_OPS['$_ds_op'].load()" \
        >/tmp/ds_prebuild_$_ds_op.log 2>&1 && echo "DeepSpeed op $_ds_op built" || \
        { echo "DeepSpeed op $_ds_op did not build:"; tail -5 /tmp/ds_prebuild_$_ds_op.log; }
done
