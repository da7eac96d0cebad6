"""The CUDA multi-tensor ops compile and link wherever nvcc is (CI has no GPU), and their
bindings refuse bad input before any CUDA call, so these run on CPU-only machines."""
from __future__ import annotations

import pytest
import torch

from op_builder import ALL_OPS, toolchain
from op_builder.builder import csrc_root
from op_builder.compress_quant import CompressQuantCUDABuilder
from op_builder.evoformer_attn import EvoformerAttnBuilder
from op_builder.fused_adam import FusedAdamBuilder
from op_builder.fused_lamb import FusedLambBuilder
from op_builder.fused_lion import FusedLionBuilder
from op_builder.moe_gating import MoEGatingCUDABuilder
from op_builder.multi_tensor import MultiTensorOpsBuilder
from op_builder.onebit import OnebitCUDABuilder
from op_builder.quantizer import QuantizerCUDABuilder
from op_builder.random_ltd import RandomLTDCUDABuilder
from op_builder.sparse_attn import SparseAttnBuilder
from op_builder.transformer import TransformerBuilder
from op_builder.transformer_inference import InferenceBuilder

CUDA_BUILDERS = [MultiTensorOpsBuilder, FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder, MoEGatingCUDABuilder,
                 InferenceBuilder, OnebitCUDABuilder, QuantizerCUDABuilder, RandomLTDCUDABuilder,
                 EvoformerAttnBuilder, TransformerBuilder, CompressQuantCUDABuilder, SparseAttnBuilder]
EXPECTED = {
    "compress_quant_cuda": {"fake_quant", "ternary", "binary"},
    "multi_tensor_ops": {"l2norm", "scale", "copy", "flatten", "unflatten", "adam_epilogue",
                         "tensors_per_launch", "chunk_elems"},
    "fused_adam": {"multi_tensor_adam"},
    "fused_lamb": {"multi_tensor_lamb"},
    "fused_lion": {"multi_tensor_lion"},
    "moe_gating_cuda": {"select", "counts", "plan", "dispatch", "combine", "route_dots"},
    "onebit_cuda": {"compensate", "pack", "unpack"},
    "quantizer_cuda": {"quantize", "dequantize", "dequantize_sum"},
    "random_ltd_cuda": {"gather", "scatter", "mask_gather"},
    "evoformer_attn": {"forward", "forward_tc", "backward"},
    "sparse_attn": {"forward", "backward"},
    "transformer": {"bias_gelu", "gelu_backward", "residual_norm", "norm_backward", "softmax", "softmax_backward",
                    "stack_qkv_grad", "dropout_keep"},
    "transformer_inference": {"add_norm", "qkv_rotary_cache", "attention", "masked_softmax", "bias_gelu",
                              "silu_mul", "quant_gemv", "dequantize"},
}
no_nvcc = pytest.mark.skipif(toolchain.nvcc() is None or not toolchain.cudart_static_available(),
                             reason="nvcc and libcudart_static are needed to compile the CUDA ops")


def test_builders_registered_and_cover_every_cu_file():
    for b in CUDA_BUILDERS:
        assert ALL_OPS[b.NAME] is b
    used = {s for b in CUDA_BUILDERS for s in b().sources() if s.endswith(".cu")}
    on_disk = {f"cuda/{p.name}" for p in (csrc_root() / "cuda").glob("*.cu")}
    assert on_disk <= used, f"CUDA sources no builder compiles: {sorted(on_disk - used)}"


@no_nvcc
@pytest.mark.parametrize("builder", CUDA_BUILDERS, ids=lambda b: b.NAME)
def test_compiles_and_links(builder):
    # load() compiles unless a build of these exact sources and flags is cached (the cache key
    # hashes them), then imports the module, which needs no GPU.
    b = builder()
    module = b.load()
    assert EXPECTED[b.NAME] <= set(dir(module))
    log = b.build_dir() / "build.log"
    if log.exists():
        assert "warning" not in log.read_text().lower(), log.read_text()


@no_nvcc
def test_cpu_tensors_rejected_naming_the_argument():
    adam = FusedAdamBuilder().load()
    t = [torch.zeros(8)]
    with pytest.raises(ValueError, match=r"'grads\[0\]' must be on the cuda device"):
        adam.multi_tensor_adam(t, t, t, t, None, 1e-3, 0.9, 0.999, 1e-8, 1, True, True, 0.0, 1.0)
    with pytest.raises(TypeError, match="'lr' must be a float"):
        adam.multi_tensor_adam(t, t, t, t, None, "x", 0.9, 0.999, 1e-8, 1, True, True, 0.0, 1.0)
    with pytest.raises(TypeError, match=r"'grads\[0\]' must be a torch.Tensor"):
        adam.multi_tensor_adam([1], t, t, t, None, 1e-3, 0.9, 0.999, 1e-8, 1, True, True, 0.0, 1.0)
    with pytest.raises(ValueError, match="'step' must be >= 1"):
        adam.multi_tensor_adam(t, t, t, t, None, 1e-3, 0.9, 0.999, 1e-8, 0, True, True, 0.0, 1.0)
    ops = MultiTensorOpsBuilder().load()
    with pytest.raises(ValueError, match=r"'tensors\[0\]' must be on the cuda device"):
        ops.l2norm(t, torch.zeros(3, dtype=torch.float64), torch.zeros(1), None, None)
    with pytest.raises(ValueError, match=r"'src\[0\]' must be on the cuda device"):
        ops.copy(t, t)
    lion = FusedLionBuilder().load()
    with pytest.raises(ValueError, match=r"'grads\[0\]' must be on the cuda device"):
        lion.multi_tensor_lion(t, t, t, None, 1e-3, 0.9, 0.99, 0.0)
    with pytest.raises(TypeError, match="takes exactly 8 arguments"):
        lion.multi_tensor_lion(t, t, t)


@no_nvcc
def test_launch_geometry():
    ops = MultiTensorOpsBuilder().load()
    caps = [ops.tensors_per_launch(d) for d in range(1, 6)]
    assert caps == sorted(caps, reverse=True) and caps[-1] > 256
    assert ops.chunk_elems() % 4 == 0
    with pytest.raises(ValueError, match="'depth'"):
        ops.tensors_per_launch(6)


@no_nvcc
def test_fused_optimizers_amsgrad_refused():
    """FusedAdam, FusedLion and FusedLamb step host parameters (tests/unit/test_fused_on_cpu.py)."""
    from deepspeed_c.ops.adam import FusedAdam
    from deepspeed_c.ops.lamb import FusedLamb

    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)
