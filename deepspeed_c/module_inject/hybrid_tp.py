"""Inference tensor parallelism for the hybrid engine (`hybrid_engine.inference_tp_size` > 1): each rank of a
group of consecutive ranks holds 1/tp of every fused block (Megatron's split), the group generates the
prompts of all its ranks together, and each rank keeps its own rows of the result.

Split of one block over tp ranks, rank r: the query heads [r H/tp, (r+1) H/tp) and the kv heads
[r Hkv/tp, (r+1) Hkv/tp) (rows of wqkv and bqkv), the matching columns of wo, rows r of each of the MLP's
up projections (gate and up for SiLU-gated MLPs) and the matching columns of w2. The attention output and the
MLP output are partial sums: one all-reduce each over the group, before their (whole, replicated) bias.
Norms, embeddings and the LM head stay whole on every rank."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F

from deepspeed_c.module_inject.fused_block import BlockSpec, FusedDecoderBlock, StepContext
from deepspeed_c.ops.transformer.inference import kernels as K


def check_divisible(spec: BlockSpec, ffn: int, tp: int) -> Optional[str]:
    """Why the block cannot be split over tp ranks (None when it can)."""
    for what, n in (("attention heads", spec.n_heads), ("key/value heads", spec.n_kv), ("MLP width", ffn)):
        if n % tp != 0:
            return f"its {n} {what} do not split over hybrid_engine.inference_tp_size={tp} ranks"
    return None


def local_spec(spec: BlockSpec, tp: int) -> BlockSpec:
    return dataclasses.replace(spec, n_heads=spec.n_heads // tp, n_kv=spec.n_kv // tp)


def _rows(t: Optional[torch.Tensor], parts: list[int], r: int, tp: int) -> Optional[torch.Tensor]:
    """Of each consecutive segment (sizes `parts`) of dim 0, its r-th of tp equal slices, concatenated."""
    if t is None:
        return None
    out, start = [], 0
    for n in parts:
        k = n // tp
        out.append(t[start + r * k:start + (r + 1) * k])
        start += n
    return torch.cat(out)


def shard_args(spec: BlockSpec, args: tuple, r: int, tp: int) -> tuple:
    """FusedDecoderBlock's (ln1, ln2, wqkv, bqkv, wo, bo, w1, b1, w2, b2), whole -> rank r's part."""
    ln1, ln2, wqkv, bqkv, wo, bo, w1, b1, w2, b2 = args
    d = spec.head_dim
    qkv = [spec.n_heads * d, spec.n_kv * d, spec.n_kv * d]
    up = [w1.shape[0] // 2] * 2 if spec.gated_silu else [w1.shape[0]]
    w2_local = _rows(w2.t(), [w2.shape[1]], r, tp).t()
    wo_local = _rows(wo.t(), [wo.shape[1]], r, tp).t()
    return (ln1, ln2, _rows(wqkv, qkv, r, tp), _rows(bqkv, qkv, r, tp), wo_local, bo,
            _rows(w1, up, r, tp), _rows(b1, up, r, tp), w2_local, b2)


class TPFusedDecoderBlock(FusedDecoderBlock):
    """FusedDecoderBlock holding one rank's part; its two partial products are summed over `group`."""

    def __init__(self, spec: BlockSpec, layer: int, scale: float, *args: Any, group: Any = None) -> None:
        super().__init__(spec, layer, scale, *args)
        self.group = group

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor], yb: Optional[torch.Tensor], batch: int,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        import torch.distributed as dist

        s = self.spec
        n_tok = x.shape[0]
        t = n_tok // batch
        r = torch.empty_like(x) if y is not None else None
        n = torch.empty_like(x)
        K.add_norm(x, y, yb, self.ln1_w, self.ln1_b, s.eps, r, n)
        r = x if r is None else r
        qkv = F.linear(n, self.wqkv).view(batch, t, -1)
        q = torch.empty(batch, t, s.n_heads, s.head_dim, dtype=x.dtype, device=x.device)
        kc, vc = ctx.cache[self.layer, 0], ctx.cache[self.layer, 1]
        K.qkv_rotary_cache(qkv, self.bqkv, ctx.cos, ctx.sin, ctx.positions, ctx.past, ctx.past_dev,
                           kc, vc, q, s.n_heads, s.n_kv, s.head_dim, s.head_dim)
        a = torch.empty_like(q)
        K.attention(q, kc, vc, ctx.past, ctx.past_dev, ctx.key_mask, self.scale, a)
        o = F.linear(a.view(n_tok, s.n_heads * s.head_dim), self.wo)
        dist.all_reduce(o, group=self.group)
        r2 = torch.empty_like(x)
        n2 = torch.empty_like(x)
        K.add_norm(r, o, self.bo, self.ln2_w, self.ln2_b, s.eps, r2, n2)
        h = F.linear(n2, self.w1)
        if s.gated_silu:
            act = torch.empty(n_tok, h.shape[1] // 2, dtype=x.dtype, device=x.device)
            K.silu_mul(h, self.b1, act)
        else:
            K.bias_gelu(h, self.b1, s.gelu_tanh)
            act = h
        out = F.linear(act, self.w2)
        dist.all_reduce(out, group=self.group)
        return r2, out, self.b2
