"""Front end of the fused inference kernels: tensors on a GPU go to the CUDA op
`transformer_inference` (csrc/cuda/inference_*.cu, built by op_builder on first use), tensors on
the host to the torch reference (`reference.py`). Callers allocate every output.

The past length reaches the kernels as a device int32 (`past_dev`), not as an argument: a
captured CUDA graph of the decode step replays with a new length without being recaptured."""
from __future__ import annotations

from types import ModuleType

import torch

from deepspeed_c.ops.transformer.inference import reference as ref

_op: ModuleType | None = None


def cuda_op() -> ModuleType:
    """The built CUDA op (built on first call; OpBuildError quotes the compiler when it fails)."""
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import InferenceBuilder
        _op = InferenceBuilder().load()
    return _op


def add_norm(x: torch.Tensor, y: torch.Tensor | None, bias: torch.Tensor | None, gamma: torch.Tensor,
             beta: torch.Tensor | None, eps: float, r_out: torch.Tensor | None, n_out: torch.Tensor) -> None:
    if x.is_cuda:
        cuda_op().add_norm(x, y, bias, gamma, beta, float(eps), r_out, n_out)
    else:
        ref.add_norm(x, y, bias, gamma, beta, eps, r_out, n_out)


def qkv_rotary_cache(qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor | None,
                     sin: torch.Tensor | None, positions: torch.Tensor | None, past: int,
                     past_dev: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     q_out: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, rot: int) -> None:
    if qkv.is_cuda:
        cuda_op().qkv_rotary_cache(qkv, bias, cos, sin, positions, past_dev, k_cache, v_cache, q_out,
                                   n_heads, n_kv, head_dim, rot)
    else:
        ref.qkv_rotary_cache(qkv, bias, cos, sin, positions, past, k_cache, v_cache, q_out,
                             n_heads, n_kv, head_dim, rot)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, past: int,
              past_dev: torch.Tensor, key_mask: torch.Tensor | None, scale: float, out: torch.Tensor) -> None:
    if q.is_cuda:
        cuda_op().attention(q, k_cache, v_cache, past_dev, key_mask, float(scale), out)
    else:
        ref.attention(q, k_cache, v_cache, past, key_mask, scale, out)


def bias_gelu(h: torch.Tensor, bias: torch.Tensor | None, approximate: bool) -> None:
    if h.is_cuda:
        cuda_op().bias_gelu(h, bias, bool(approximate))
    else:
        ref.bias_gelu(h, bias, approximate)


def silu_mul(gu: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if gu.is_cuda:
        cuda_op().silu_mul(gu, bias, out)
    else:
        ref.silu_mul(gu, bias, out)
