"""FPDT's chunked attention as one autograd Function: QKV projection, Ulysses all-to-all, causal attention
with an online softmax across chunks, and the reverse all-to-all, one sequence chunk at a time.

Each rank holds its local sequence as `num_chunks` chunks of c = s_local / num_chunks tokens, laid out by
FPDT_InputConstruct so that local chunk i of every rank, gathered in rank order by the all-to-all, is the
contiguous global span [i*C, (i+1)*C) with C = c * sp. Query chunk i therefore attends to the gathered
key/value chunks 0..i (the last one causally), merged by their log-sum-exp.

Saved for backward, per chunk: the input chunk, q/k/v (after rotary), the merged output and its lse,
each through a ChunkStore (resident, or in host buffers with one-ahead prefetch when offloading).
Backward walks key/value chunks i in order and, for each, the query chunks j >= i, recomputing the
block's probabilities from q_j, k_i and (out_j, lse_j); dq_j accumulates in the store. After walk i,
dq_i, dk_i and dv_i are complete, so chunk i's projection gradients and input gradient are formed then.

That backward runs under no_grad on chunks kept apart from the input's history (offloaded, when asked), so it
cannot give a differentiable gradient: a create_graph backward raises, naming create_graph. Under a torch.func
transform the function steps aside for the same attention in plain torch ops (whole-sequence causal softmax
over the gathered chunks, the exchanges through layer.py's torch.func-ready all-to-all).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from deepspeed_c.sequence.fpdt_kernels import block_backward, block_forward, merge
from deepspeed_c.sequence.fpdt_offload import ChunkStore
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.sequence.layer import _all_to_all, _SeqAllToAll, apply_rotary_pos_emb

_SEQ, _HEADS = 1, 2  # [b, s, h, d]


def _rotary_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Transpose of apply_rotary_pos_emb: rot(x) = x*cos + R(x)*sin with R(x) = cat(-x2, x1), whose
    transpose is R^T(y) = cat(y2, -y1)."""
    rot_dim = cos.shape[-1]
    g, rest = grad[..., :rot_dim], grad[..., rot_dim:]
    gs = g * sin
    first, second = gs.chunk(2, dim=-1)
    out = g * cos + torch.cat((second, -first), dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class _Plan:
    """The shapes and collectives one call shares between forward and backward."""

    def __init__(self, spg: Any, num_chunks: int, chunk: int, proj: int, kv_proj: int, head_dim: int,
                 rotary: Optional[Tuple[Tensor, Tensor]]) -> None:
        self.spg, self.num_chunks, self.chunk = spg, num_chunks, chunk
        self.proj, self.kv_proj, self.head_dim = proj, kv_proj, head_dim
        self.scale = head_dim ** -0.5
        self.cos = self.sin = None
        if rotary is not None:  # (cos, sin) laid out [s, b|1, 1, d] over the global sequence
            self.cos, self.sin = rotary[0].permute(1, 0, 2, 3), rotary[1].permute(1, 0, 2, 3)

    def rows(self, i: int) -> slice:
        return slice(i * self.chunk, (i + 1) * self.chunk)

    def positions(self, i: int, gathered: int) -> Tuple[Tensor, Tensor]:
        span = slice(i * gathered, (i + 1) * gathered)
        return self.cos[:, span], self.sin[:, span]

    def to_heads(self, part: Tensor) -> Tensor:
        """[c, b, n*hd] (a projection slice of this rank's tokens) -> [b, C, n/sp, hd] gathered sequence."""
        c, b, _ = part.shape
        t = part.reshape(c, b, -1, self.head_dim).permute(1, 0, 2, 3).contiguous()
        return _all_to_all(t, _HEADS, _SEQ, self.spg)

    def to_tokens(self, t: Tensor) -> Tensor:
        """[b, C, n/sp, hd] -> [c, b, n*hd] (this rank's tokens, all heads)."""
        back = _all_to_all(t.contiguous(), _SEQ, _HEADS, self.spg)
        return back.flatten(2).permute(1, 0, 2)


def _project(plan: _Plan, x: Tensor, weight: Tensor, bias: Optional[Tensor], i: int) -> List[Tensor]:
    qkv = torch.matmul(x, weight.t())
    if bias is not None:
        qkv = qkv + bias
    p, kv = plan.proj, plan.kv_proj
    q, k, v = (plan.to_heads(qkv[:, :, s]) for s in (slice(0, p), slice(p, p + kv), slice(p + kv, None)))
    if plan.cos is not None:
        cos, sin = plan.positions(i, q.shape[1])
        # the tables may be fp32 over bf16 activations: the result keeps the activations' dtype
        q, k = apply_rotary_pos_emb(q, cos, sin).to(v.dtype), apply_rotary_pos_emb(k, cos, sin).to(v.dtype)
    return [q, k, v]


def _plain_attention(x: Tensor, weight: Tensor, bias: Optional[Tensor], plan: _Plan) -> Tensor:
    """The same result through differentiable torch ops: every chunk's q/k/v gathered (chunk i of every rank is
    the global span i, so their concatenation is the sequence in order), one causal softmax, and back."""
    qkv = torch.matmul(x, weight.t())
    if bias is not None:
        qkv = qkv + bias
    p, kv, n = plan.proj, plan.kv_proj, plan.num_chunks
    heads = lambda part: _SeqAllToAll.apply(  # noqa: E731 ([c, b, n*hd] -> [b, C, n/sp, hd])
        plan.spg, part.reshape(part.shape[0], part.shape[1], -1, plan.head_dim).permute(1, 0, 2, 3), _HEADS, _SEQ)
    qs, ks, vs = [], [], []
    for i in range(n):
        chunk = qkv[plan.rows(i)]
        q, k, v = (heads(chunk[:, :, cols]) for cols in (slice(0, p), slice(p, p + kv), slice(p + kv, None)))
        if plan.cos is not None:
            cos, sin = plan.positions(i, q.shape[1])
            q, k = apply_rotary_pos_emb(q, cos, sin).to(v.dtype), apply_rotary_pos_emb(k, cos, sin).to(v.dtype)
        qs.append(q), ks.append(k), vs.append(v)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    q, k, v = (torch.cat(t, dim=1).to(acc) for t in (qs, ks, vs))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * plan.scale
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(causal, float("-inf")).softmax(-1), v).to(x.dtype)
    return torch.cat([_SeqAllToAll.apply(plan.spg, o.contiguous(), _SEQ, _HEADS) for o in out.chunk(n, dim=1)], dim=1)


class _FPDTAttentionNode(torch.autograd.Function):
    """FPDTAttentionFunction's autograd node (see FPDTAttentionFunction)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], plan: _Plan,  # type: ignore[override]
                offload: bool) -> Tensor:
        n = plan.num_chunks
        store = ChunkStore(x.device, offload)
        outputs: List[Tensor] = []
        with torch.no_grad():
            for i in range(n):
                xc = x[plan.rows(i)]
                q, k, v = _project(plan, xc, weight, bias, i)
                store.put(("x", i), xc.contiguous())
                for name, t in (("q", q), ("k", k), ("v", v)):
                    store.put((name, i), t, keep=True)
                out = lse = None
                for j in range(i + 1):
                    if j + 1 < i:  # double buffer: the next key/value chunk comes in while this one computes
                        store.prefetch(("k", j + 1))
                        store.prefetch(("v", j + 1))
                    bo, bl = block_forward(q, store.get(("k", j)), store.get(("v", j)), j == i, plan.scale)
                    out, lse = merge(out, lse, bo, bl)
                    if j < i:
                        store.release(("k", j))
                        store.release(("v", j))
                out = out.to(x.dtype)
                store.put(("o", i), out)
                store.put(("lse", i), lse.float())
                for name in ("q", "k", "v"):
                    store.release((name, i))
                if i + 1 < n:
                    store.prefetch(("k", 0))
                    store.prefetch(("v", 0))
                outputs.append(_all_to_all(out, _SEQ, _HEADS, plan.spg))
            store.synchronize()
        ctx.store, ctx.plan = store, plan
        ctx.save_for_backward(weight, bias)
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        return torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError("FPDT_Attention: a create_graph backward (autograd.grad(..., create_graph=True) or "
                               "backward(create_graph=True)) through FPDT's chunked attention is not supported: its "
                               "backward recomputes detached chunks and cannot return a differentiable gradient; "
                               "use DistributedAttention (Ulysses without FPDT) for higher-order gradients")
        plan, store = ctx.plan, ctx.store
        weight, bias = ctx.saved_tensors
        n, dtype = plan.num_chunks, ctx.x_dtype
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if ctx.has_bias else None
        grad_x: List[Tensor] = []
        with torch.no_grad():
            for j in range(n):  # dout chunks gathered once, then stored like the forward's chunks
                store.put(("do", j), _all_to_all(grad[:, plan.rows(j)].contiguous(), _HEADS, _SEQ, plan.spg))
            for i in range(n):
                k, v = store.get(("k", i)), store.get(("v", i))
                dk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv = torch.zeros(v.shape, dtype=acc, device=v.device)
                dq_i: Optional[Tensor] = None
                for j in range(i, n):
                    if j + 1 < n:
                        for name in ("q", "o", "lse", "do", "dq"):
                            if (name, j + 1) in store:
                                store.prefetch((name, j + 1))
                    q, o, lse, do = (store.get((name, j)) for name in ("q", "o", "lse", "do"))
                    dqb, dkb, dvb = block_backward(do, q, k, v, o, lse, i == j, plan.scale)
                    dk.add_(dkb)
                    dv.add_(dvb)
                    dq = dqb.to(acc) if ("dq", j) not in store else store.get(("dq", j)).add_(dqb)
                    if j == i:
                        dq_i = dq  # its last contribution: key chunk i is the last one query chunk i sees
                    else:
                        store.put(("dq", j), dq)
                    for name in ("q", "o", "lse", "do"):
                        store.release((name, j))
                assert dq_i is not None
                gx = _input_grad(plan, store, weight, grad_w, grad_b, dq_i, dk, dv, i, dtype)
                grad_x.append(gx)
                for name in ("q", "k", "v", "o", "lse", "do", "dq", "x"):
                    store.drop((name, i))
            store.synchronize()
        ctx.store = None
        return (torch.cat(grad_x, dim=0), grad_w.to(weight.dtype),
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None)


class FPDTAttentionFunction(torch.autograd.Function):
    """forward(x [s_local, b, hidden], weight, bias, plan, offload) -> [b, s_local, heads, head_dim]."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, x: Tensor, weight: Tensor, bias: Optional[Tensor], plan: _Plan,  # type: ignore[override]
              offload: bool) -> Tensor:
        if not torch.compiler.is_compiling() and transforms_active():
            return _plain_attention(x, weight, bias, plan)
        return _FPDTAttentionNode.apply(x, weight, bias, plan, offload)


def _input_grad(plan: _Plan, store: ChunkStore, weight: Tensor, grad_w: Tensor, grad_b: Optional[Tensor],
                dq: Tensor, dk: Tensor, dv: Tensor, i: int, dtype: torch.dtype) -> Tensor:
    """Chunk i's finished dq/dk/dv -> projection gradients (accumulated) and the input gradient."""
    if plan.cos is not None:
        cos, sin = plan.positions(i, dq.shape[1])
        dq, dk = _rotary_backward(dq, cos, sin), _rotary_backward(dk, cos, sin)
    # the exchange carries the activations' dtype, as the forward's did
    dqkv = torch.cat([plan.to_tokens(t.to(dtype)) for t in (dq, dk, dv)], dim=-1)  # [c, b, p + 2kv]
    xc = store.get(("x", i))
    flat_g = dqkv.reshape(-1, dqkv.shape[-1]).to(grad_w.dtype)
    grad_w.add_(torch.matmul(flat_g.t(), xc.reshape(-1, xc.shape[-1]).to(grad_w.dtype)))
    if grad_b is not None:
        grad_b.add_(flat_g.sum(0))
    return torch.matmul(dqkv, weight).to(dtype)
