"""deepspeed.sequence.layer: DeepSpeed-Ulysses sequence parallelism.

Each rank of the sequence-parallel group holds a contiguous slice of the sequence for every head.
Attention needs the whole sequence, so q/k/v are all-to-all'ed from sequence-sharded/all-heads to
whole-sequence/head-sharded, the caller's local attention runs on its heads, and the result is
all-to-all'ed back. The all-to-all's gradient is the opposite all-to-all, so autograd composes (its backward
is the exchange's own autograd node again: create_graph gets the second-order terms). Under a torch.func
transform the exchange runs as a Function torch.func can carry (setup_context, and a vmap rule that moves the
vmapped dimension into the exchanged tensor), so torch.func.grad and vmap(grad) work across the group.

Layouts (`batch_dim_idx`): 0 is [batch, seq, heads, head_dim], 1 is [seq, batch, heads, head_dim].
Heads (query and key/value, GQA included) must divide by the sequence-parallel size: unlike
DeepSpeed's uneven-head path, an indivisible head count raises (it names the count and the size).
Every rank must hold the same local sequence length (pad the sequence to a multiple of the size); a
mismatch raises ValueError on every rank (checked each call on the host, on the first call on a GPU).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

from deepspeed_c import comm as dist
from deepspeed_c.runtime.autograd_paths import transforms_active


def _seq_dim(batch_dim_idx: int) -> int:
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), got {batch_dim_idx!r}")
    return 1 - batch_dim_idx


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: Any) -> Tensor:
    """Splits `x` into P chunks along scatter_dim, sends chunk j to rank j, and concatenates what
    arrives (in rank order) along gather_dim. Pure layout around one all_to_all_single."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    shape = list(x.shape)
    if shape[scatter_dim] % world != 0:
        raise ValueError(f"DistributedAttention: dimension {scatter_dim} of size {shape[scatter_dim]} (shape "
                         f"{tuple(shape)}) is not divisible by the sequence parallel size {world}")
    split = shape[:scatter_dim] + [world, shape[scatter_dim] // world] + shape[scatter_dim + 1:]
    send = x.reshape(split).movedim(scatter_dim, 0).contiguous()  # chunk j leads: all_to_all_single splits dim 0
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is rank j's piece of the gathered dimension: put that index just before gather_dim and merge
    merged = recv.movedim(0, gather_dim)
    out_shape = list(send.shape[1:])
    out_shape[gather_dim] *= world
    return merged.reshape(out_shape)


class _SeqAllToAllNode(torch.autograd.Function):
    """_SeqAllToAll's autograd node (see _SeqAllToAll)."""

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:  # type: ignore[override]
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, _SeqAllToAllNode.apply(ctx.group, grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None


class _SeqAllToAll(torch.autograd.Function):
    """all-to-all whose backward is the reverse all-to-all (scatter and gather swapped)."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, group: Any, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:  # type: ignore[override]
        if not torch.compiler.is_compiling() and transforms_active():
            return _FuncAllToAll.apply(group, x, scatter_dim, gather_dim)
        return _SeqAllToAllNode.apply(group, x, scatter_dim, gather_dim)


class _FuncAllToAll(torch.autograd.Function):
    """The same exchange for torch.func (grad, vmap, their compositions)."""

    @staticmethod
    def forward(group: Any, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:  # type: ignore[override]
        out = _all_to_all(x, scatter_dim, gather_dim, group)
        return out.view_as(out) if out is x else out  # a new tensor: torch.func does not take an input back

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.group, _, ctx.scatter_dim, ctx.gather_dim = inputs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, _FuncAllToAll.apply(ctx.group, grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, x: Tensor, scatter_dim: int, gather_dim: int) -> tuple:
        # every rank vmaps the same size: the vmapped dimension leads, the exchanged ones shift by one
        dim = in_dims[1]
        if dim is None:
            return _FuncAllToAll.apply(group, x, scatter_dim, gather_dim), None
        return _FuncAllToAll.apply(group, x.movedim(dim, 0), scatter_dim % (x.dim() - 1) + 1,
                                   gather_dim % (x.dim() - 1) + 1), 0


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary embedding on the leading rot_dim channels of t (the rest pass through)."""
    rot_dim = freqs_cos.shape[-1]
    rot, rest = t[..., :rot_dim], t[..., rot_dim:]
    rot = rot * freqs_cos + _rotate_half(rot) * freqs_sin
    return rot if rest.shape[-1] == 0 else torch.cat((rot, rest), dim=-1)


class DistributedAttention(Module):
    """Wraps a local attention so that it runs over a sequence sharded across `sequence_process_group`.

    local_attention(q, k, v, *args, **kwargs) sees the whole sequence and heads/P heads.
    `scatter_idx` is the head dimension (2 in both layouts); `gather_idx` is kept for DeepSpeed's
    signature: the sequence dimension follows from `batch_dim_idx` at each forward, as in DeepSpeed.
    `sp_stream` (DeepSpeed's communication overlap) is accepted and runs the exchanges in order.
    """

    def __init__(self, local_attention: Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        if scatter_idx < 2:
            raise ValueError(f"DistributedAttention: scatter_idx={scatter_idx} must name the head dimension (2) of "
                             "[b, s, h, d] / [s, b, h, d] inputs")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self._shapes_checked = False

    def _check_same_shape(self, query: Tensor) -> None:
        """Ranks holding different local shapes would hand all_to_all_single mismatched buffers (gloo aborts
        the process, NCCL hangs). One tiny all-reduce compares them: on every call on the host, on the first
        call on a GPU (a later check there would synchronise the stream each forward)."""
        if self._shapes_checked and query.device.type != "cpu":
            return
        self._shapes_checked = True
        from deepspeed_c.comm import collective_device

        world = dist.get_world_size(self.spg)
        shape = torch.tensor(list(query.shape), dtype=torch.int64, device=collective_device(self.spg))
        lo, hi = shape.clone(), shape.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.spg)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.spg)
        if not torch.equal(lo, hi):
            raise ValueError(f"DistributedAttention: the ranks of the sequence-parallel group hold query tensors of "
                             f"different shapes (this rank {tuple(query.shape)}; per-dimension min "
                             f"{tuple(lo.tolist())}, max {tuple(hi.tolist())}); every rank must hold an equal slice "
                             f"of the sequence: pad the sequence to a multiple of the sequence parallel size {world}")

    def _check_heads(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        world = dist.get_world_size(self.spg)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise ValueError(f"DistributedAttention: {name} must be 4-D ([b, s, h, d] or [s, b, h, d]), got shape "
                                 f"{tuple(t.shape)}")
            heads = t.shape[self.scatter_idx]
            if heads % world != 0:
                raise ValueError(f"DistributedAttention: {name} has {heads} heads, not divisible by the sequence "
                                 f"parallel size {world}; choose a sequence_parallel_size that divides the head count")
        if self.num_kv_heads is not None and self.num_kv_heads % world != 0:
            raise ValueError(f"DistributedAttention: num_kv_heads={self.num_kv_heads} is not divisible by the sequence "
                             f"parallel size {world}")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        seq = _seq_dim(batch_dim_idx)
        self._check_heads(query, key, value)
        if dist.get_world_size(self.spg) > 1:
            self._check_same_shape(query)
        heads = self.scatter_idx
        q = _SeqAllToAll.apply(self.spg, query, heads, seq)
        k = _SeqAllToAll.apply(self.spg, key, heads, seq)
        v = _SeqAllToAll.apply(self.spg, value, heads, seq)
        if rotary_pos_emb is not None:  # (cos, sin), each [b?, s, 1, d]-like as DeepSpeed lays them out
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(self.spg, context, seq, heads)
