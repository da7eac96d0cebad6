"""FPDT_FFN: the Megatron MLP (x @ w1^T + b1, tanh-GeLU, @ w2^T [+ b2]) over sequence chunks, so only one
chunk's intermediate activation (4x hidden wide) ever exists; backward recomputes it per chunk.

x is [s, b, hidden]; chunks are `chunk_size` rows of dim 0. Returns (out, b2) when add_bias is False
(Megatron's "return the bias for a fused bias-add" convention; b2's gradient is then the caller's), else
(out + b2, None). Weight gradients accumulate in fp32 (fp64 for fp64).

The chunked backward runs under no_grad, so its gradients are constants: a create_graph backward (grad mode
on inside backward) recomputes the MLP through plain autograd from the saved inputs instead (the second-order
terms included), and under a torch.func transform apply runs that plain composition (no custom Function)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from deepspeed_c.runtime.autograd_paths import tensor_hooks_paused, transforms_active

_C0, _C1 = 0.79788456, 0.044715  # sqrt(2/pi) and the cubic coefficient of the tanh approximation


def bias_gelu(x: Tensor) -> Tensor:
    return x * 0.5 * (1.0 + torch.tanh(_C0 * x * (1 + _C1 * x * x)))


def bias_gelu_back(g: Tensor, x: Tensor) -> Tensor:
    t = torch.tanh(_C0 * x * (1 + _C1 * x * x))
    return g * (0.5 * x * (1 - t * t) * (_C0 + 3 * _C0 * _C1 * x * x) + 0.5 * (1 + t))


def _chunks(who: str, rows: int, chunk_size: int) -> int:
    if not isinstance(chunk_size, int) or chunk_size <= 0 or rows % chunk_size != 0:
        raise ValueError(f"{who}: the sequence dimension ({rows} rows) is not a multiple of chunk_size="
                         f"{chunk_size!r}")
    return rows // chunk_size


def _plain(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, add_bias: bool) -> Tensor:
    """The same MLP through torch's differentiable ops, unchunked."""
    out = torch.matmul(bias_gelu(torch.matmul(x, w1.t()) + b1), w2.t())
    return out + b2 if add_bias else out


class _FPDTFFNNode(torch.autograd.Function):
    """FPDT_FFN's autograd node (see FPDT_FFN)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,  # type: ignore[override]
                add_bias: bool, chunk_size: int) -> Tuple[Tensor, Optional[Tensor]]:
        n = _chunks("FPDT_FFN", x.shape[0], chunk_size)
        out = torch.empty(x.shape[:-1] + (w2.shape[0],), dtype=x.dtype, device=x.device)
        with torch.no_grad():
            for i in range(n):
                rows = slice(i * chunk_size, (i + 1) * chunk_size)
                h = bias_gelu(torch.matmul(x[rows], w1.t()) + b1)
                out[rows] = torch.matmul(h, w2.t()) + b2 if add_bias else torch.matmul(h, w2.t())
        ctx.save_for_backward(x, w1, b1, w2, b2)
        ctx.add_bias, ctx.chunk_size, ctx.n = add_bias, chunk_size, n
        return out, (None if add_bias else b2)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_bias: Optional[Tensor]) -> tuple:  # type: ignore[override]
        x, w1, b1, w2, b2 = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _differentiable_backward(ctx, (x, w1, b1, w2, b2), grad_out, grad_bias)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        gw1 = torch.zeros(w1.shape, dtype=acc, device=w1.device)
        gb1 = torch.zeros(b1.shape, dtype=acc, device=b1.device)
        gw2 = torch.zeros(w2.shape, dtype=acc, device=w2.device)
        gb2 = torch.zeros(b2.shape, dtype=acc, device=b2.device)
        gx = torch.empty_like(x)
        with torch.no_grad():
            for i in range(ctx.n):
                rows = slice(i * ctx.chunk_size, (i + 1) * ctx.chunk_size)
                xc, go = x[rows], grad_out[rows]
                pre = torch.matmul(xc, w1.t()) + b1  # recomputed: the forward kept no intermediate
                go2 = go.reshape(-1, go.shape[-1]).to(acc)
                gw2.add_(torch.matmul(go2.t(), bias_gelu(pre).reshape(-1, pre.shape[-1]).to(acc)))
                if ctx.add_bias:
                    gb2.add_(go2.sum(0))
                g_pre = bias_gelu_back(torch.matmul(go, w2), pre)
                g_pre2 = g_pre.reshape(-1, g_pre.shape[-1]).to(acc)
                gw1.add_(torch.matmul(g_pre2.t(), xc.reshape(-1, xc.shape[-1]).to(acc)))
                gb1.add_(g_pre2.sum(0))
                gx[rows] = torch.matmul(g_pre, w1)
        if grad_bias is not None and not ctx.add_bias:
            gb2.add_(grad_bias.to(acc))
        return gx, gw1.to(w1.dtype), gb1.to(b1.dtype), gw2.to(w2.dtype), gb2.to(b2.dtype), None, None


class FPDT_FFN(torch.autograd.Function):
    """FPDT_FFN.apply(x, w1, b1, w2, b2, add_bias, chunk_size) -> (out, b2 or None)."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, add_bias: bool,  # type: ignore[override]
              chunk_size: int) -> Tuple[Tensor, Optional[Tensor]]:
        if not torch.compiler.is_compiling() and transforms_active():
            _chunks("FPDT_FFN", x.shape[0], chunk_size)
            return _plain(x, w1, b1, w2, b2, add_bias), (None if add_bias else b2)
        return _FPDTFFNNode.apply(x, w1, b1, w2, b2, add_bias, chunk_size)


def _differentiable_backward(ctx: Any, saved: tuple, grad_out: Tensor, grad_bias: Optional[Tensor]) -> tuple:
    """create_graph: the gradients of the plain MLP from the saved inputs (which keep their history), so the
    result is differentiable in them and in grad_out."""
    wrt = [t for t in saved if t.requires_grad]
    out = _plain(*saved, ctx.add_bias)
    with tensor_hooks_paused(wrt):  # the edges deliver these gradients: hooks run there, once
        got = iter(torch.autograd.grad(out, wrt, grad_out, allow_unused=True, create_graph=True))
    grads = [next(got) if t.requires_grad else None for t in saved]
    if grad_bias is not None and not ctx.add_bias:
        grads[4] = grad_bias if grads[4] is None else grads[4] + grad_bias
    return (*grads, None, None)
