"""DS4Sci EvoformerAttention (DeepSpeed's `deepspeed.ops.deepspeed4science`): attention over
[B, N, L, H, D] with up to two additive biases, the mask bias [B, N, 1, 1, L] and the pair bias
[B, 1, H, L, L], in forward and backward, without materialising the L x L scores of all rows.

fp16/bf16 tensors on a GPU run the flash-style CUDA kernels (op `evoformer_attn`,
csrc/cuda/evoformer_*.cu); everything else runs the chunked torch path (`evoformer_reference`), which
follows the same algorithm. `kernel` picks the kernels: "auto" (tensor cores on compute capability 8.0+,
else CUDA cores), "tc" (mma.sync tensor-core tiles, sm_80+) or "simt" (CUDA cores; built for GPUs before
sm_80 only). The forward and the backward (dQ by query rows, dK/dV and the mask bias's gradient by key rows;
on tensor cores the pair bias's gradient by (query, key) blocks summed over the stack in registers) have
each form. The DSC_EVO_KERNEL environment variable sets its initial value.

The kernels' backward (and the chunked torch one) are first-order only: a create_graph backward recomputes the
attention in plain torch ops (`attention`) from the saved inputs and differentiates that, keeping the
second-order terms; under a torch.func transform the whole call is that plain composition."""
from __future__ import annotations

import math
import os
import warnings
from types import ModuleType
from typing import Sequence

import torch

from deepspeed_c.ops.deepspeed4science import evoformer_reference as ref
from deepspeed_c.runtime.autograd_paths import tensor_hooks_paused, transforms_active

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_KERNEL_HEAD_DIM = 64
_op: ModuleType | None = None
_warned_head_dim = False
kernel: str = os.environ.get("DSC_EVO_KERNEL", "auto")


_KERNELS = ("auto", "tc", "simt")


def _kernel_for(q: torch.Tensor) -> str:
    if kernel not in _KERNELS:
        raise ValueError(f"evoformer_attn.kernel must be one of {_KERNELS}, got {kernel!r}")
    ampere = torch.cuda.get_device_capability(q.device)[0] >= 8
    if kernel == "auto":
        return "tc" if ampere else "simt"
    if kernel == "simt" and ampere:  # its device code is left out of sm_80+ builds (evoformer_common.cuh)
        raise ValueError("evoformer_attn.kernel 'simt' (CUDA cores) serves GPUs before compute capability 8.0; "
                         "use 'tc' or 'auto' here")
    if kernel == "tc" and not ampere:
        raise ValueError("evoformer_attn.kernel 'tc' needs compute capability 8.0 or newer; use 'simt' or 'auto'")
    return kernel


def cuda_op() -> ModuleType:
    """The built CUDA op (built on first call; OpBuildError quotes the compiler when it fails)."""
    global _op
    if _op is None:
        from deepspeed_c.ops.op_builder import EvoformerAttnBuilder
        _op = EvoformerAttnBuilder().load()
    return _op


def _use_kernel(q: torch.Tensor) -> bool:
    global _warned_head_dim
    if not q.is_cuda or q.dtype not in _KERNEL_DTYPES:
        return False
    if q.shape[-1] > MAX_KERNEL_HEAD_DIM:
        if not _warned_head_dim:
            warnings.warn(f"DS4Sci_EvoformerAttention: head dim {q.shape[-1]} is above the CUDA kernel's "
                          f"{MAX_KERNEL_HEAD_DIM}; using the chunked torch path", stacklevel=3)
            _warned_head_dim = True
        return False
    return True


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias1: torch.Tensor | None = None,
              bias2: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention in plain torch ops (L x L scores materialised), differentiable at every order and under
    torch.func; math in float32 for half inputs, as the other paths. A row whose every score is -inf gets 0."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.to(dt).permute(0, 1, 3, 2, 4)  # [B, N, H, L, D]

    s = torch.matmul(heads(q) * (1.0 / math.sqrt(q.shape[-1])), heads(k).transpose(-1, -2))
    if bias1 is not None:
        s = s + bias1.to(dt)
    if bias2 is not None:
        s = s + bias2.to(dt)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.matmul(p, heads(v)).permute(0, 1, 3, 2, 4).to(q.dtype)


def _double_backward(ctx, d_o: torch.Tensor, saved: tuple) -> tuple:
    """create_graph: the gradients of the plain composition, recorded, so their own gradients exist."""
    wanted = [i for i, t in enumerate(saved) if t is not None and ctx.needs_input_grad[i]]
    o = attention(*saved)
    with tensor_hooks_paused([saved[i] for i in wanted]):  # the edges deliver these gradients: hooks run there
        found = torch.autograd.grad(o, [saved[i] for i in wanted], d_o, create_graph=True, allow_unused=True)
    grads: list = [None] * 5
    for i, g in zip(wanted, found):
        grads[i] = g
    return tuple(grads)


class EvoformerFusedAttention(torch.autograd.Function):
    """o = softmax(q k^T / sqrt(D) + bias1 + bias2) v over [*, L, H, D]; gradients for q, k, v and
    each bias that requires one."""

    @staticmethod
    def forward(ctx, q, k, v, bias1=None, bias2=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bias1 = None if bias1 is None else bias1.contiguous()
        bias2 = None if bias2 is None else bias2.contiguous()
        scale = 1.0 / math.sqrt(q.shape[-1])
        if _use_kernel(q):
            B, N, L, H, _ = q.shape
            o = torch.empty_like(q)
            lse = torch.empty((B, N, H, L), dtype=torch.float32, device=q.device)
            op = cuda_op()
            forward = op.forward_tc if _kernel_for(q) == "tc" else op.forward
            forward(q, k, v, bias1, bias2, o, lse, scale)
        else:
            o, lse = ref.forward(q, k, v, bias1, bias2, scale)
        ctx.save_for_backward(q, k, v, o, lse, bias1, bias2)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse, bias1, bias2 = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _double_backward(ctx, d_o, (q, k, v, bias1, bias2))
        want1 = bias1 is not None and ctx.needs_input_grad[3]
        want2 = bias2 is not None and ctx.needs_input_grad[4]
        d_o = d_o.contiguous()
        if _use_kernel(q):
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            delta = torch.empty_like(lse)
            db1 = torch.zeros(bias1.shape, dtype=torch.float32, device=q.device) if want1 else None
            db2 = torch.zeros(bias2.shape, dtype=torch.float32, device=q.device) if want2 else None
            cuda_op().backward(d_o, q, k, v, o, lse, bias1, bias2, delta, dq, dk, dv, db1, db2, ctx.scale,
                               _kernel_for(q) == "tc")
            db1 = None if db1 is None else db1.to(bias1.dtype)
            db2 = None if db2 is None else db2.to(bias2.dtype)
        else:
            dq, dk, dv, db1, db2 = ref.backward(d_o, q, k, v, o, lse, bias1, bias2, ctx.scale, want1, want2)
        return dq, dk, dv, db1, db2


def _shape(t: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(x)) for x in t) + "]"


def _check_inputs(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> None:
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"DS4Sci_EvoformerAttention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if Q.dim() != 5:
        raise ValueError(f"DS4Sci_EvoformerAttention: Q must be [B, N, L, H, D] (5 dims), got {_shape(Q.shape)}")
    for name, t in (("K", K), ("V", V)):
        if t.shape != Q.shape:
            raise ValueError(f"DS4Sci_EvoformerAttention: {name} must have Q's shape [B, N, L, H, D] = "
                             f"{_shape(Q.shape)}, got {_shape(t.shape)}")
        if t.dtype != Q.dtype or t.device != Q.device:
            raise TypeError(f"DS4Sci_EvoformerAttention: {name} must match Q's dtype and device ({Q.dtype}, "
                            f"{Q.device}), got {t.dtype}, {t.device}")
    if Q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"DS4Sci_EvoformerAttention: unsupported dtype {Q.dtype}; use float16 or bfloat16 "
                        f"(the CUDA kernel), or float32/float64 (the torch path)")


def _check_bias(bias: torch.Tensor | None, index: int, want: tuple[int, ...], Q: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    what = ("biases[0] (the mask bias) must have shape [B, N, 1, 1, L]" if index == 0 else
            "biases[1] (the pair bias) must have shape [B, 1, H, L, L]")
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"DS4Sci_EvoformerAttention: {what}, got {type(bias).__name__}")
    if tuple(bias.shape) != want:
        raise ValueError(f"DS4Sci_EvoformerAttention: {what} = {_shape(want)} for Q {_shape(Q.shape)}, "
                         f"got {_shape(bias.shape)}")
    if bias.device != Q.device:
        raise ValueError(f"DS4Sci_EvoformerAttention: biases[{index}] is on {bias.device}, Q on {Q.device}")
    if not bias.is_floating_point():
        raise TypeError(f"DS4Sci_EvoformerAttention: biases[{index}] must be a floating tensor, got {bias.dtype}")
    return bias.to(Q.dtype)


def DS4Sci_EvoformerAttention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                              biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Evoformer attention: Q, K, V [B, N, L, H, D]; `biases` up to two tensors (None for absent):
    the mask bias [B, N, 1, 1, L] and the pair bias [B, 1, H, L, L]. Returns [B, N, L, H, D]."""
    _check_inputs(Q, K, V)
    if biases is None:
        biases = []
    if not isinstance(biases, (list, tuple)) or len(biases) > 2:
        raise ValueError("DS4Sci_EvoformerAttention: biases must be a list of at most two tensors "
                         "(mask bias [B, N, 1, 1, L], pair bias [B, 1, H, L, L])")
    B, N, L, H, _ = Q.shape
    padded = list(biases) + [None] * (2 - len(biases))
    bias1 = _check_bias(padded[0], 0, (B, N, 1, 1, L), Q)
    bias2 = _check_bias(padded[1], 1, (B, 1, H, L, L), Q)
    if transforms_active():  # torch.func: the plain composition (a custom Function would need a vmap rule)
        return attention(Q, K, V, bias1, bias2)
    # made contiguous here, where autograd records the copy, so the Function saves the caller's tensors with their
    # history (a create_graph backward differentiates through them)
    Q, K, V = Q.contiguous(), K.contiguous(), V.contiguous()
    bias1 = None if bias1 is None else bias1.contiguous()
    bias2 = None if bias2 is None else bias2.contiguous()
    return EvoformerFusedAttention.apply(Q, K, V, bias1, bias2)
