"""FPDT_LogitsLoss: the LM head and per-token cross entropy over sequence chunks, so the [tokens, vocab]
logits exist one chunk at a time; the forward's input (hidden states) is kept in host memory on a GPU
(pinned, async), and backward brings it back chunk by chunk and recomputes each chunk's logits.

lm_output is this rank's [s_local, b, hidden], labels [b, s_local] (-100 ignored: loss 0, no gradient),
logit_weights [vocab, hidden]. Returns the per-token losses of the whole sequence, [s_local * sp, b] fp32,
all-gathered over the sequence-parallel group in rank order (FPDT's layout: mask it with the loss_mask
FPDT_InputConstruct returns, which is in the same order). Backward takes this rank's rows of the gradient:
every rank computes the same scalar from the gathered losses.

The chunked backward runs under no_grad from detached (possibly offloaded) chunks: a create_graph backward
raises, naming create_graph. Under a torch.func transform apply steps aside for the same losses in plain
torch ops, gathered by a Function torch.func can carry (setup_context and a vmap rule)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepspeed_c import comm as dist
from deepspeed_c.runtime.autograd_paths import transforms_active
from deepspeed_c.sequence.fpdt_checks import sp_world
from deepspeed_c.sequence.fpdt_offload import ChunkStore

IGNORE_INDEX = -100


def _chunk_logits(h: Tensor, weight: Tensor) -> Tensor:
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    return torch.matmul(h, weight.t()).to(acc)


class _GatherRows(torch.autograd.Function):
    """All-gather of dimension 0 in rank order whose gradient is this rank's rows (every rank computes the
    same scalar from the gathered values), for torch.func."""

    @staticmethod
    def forward(group: Any, rank: int, t: Tensor) -> Tensor:  # type: ignore[override]
        world = dist.get_world_size(group)
        out = torch.empty((t.shape[0] * world,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.allgather_fn(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.rank, ctx.rows = inputs[1], inputs[2].shape[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        return None, None, grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]

    @staticmethod
    def vmap(info: Any, in_dims: tuple, group: Any, rank: int, t: Tensor) -> tuple:
        if in_dims[2] is None:
            return _GatherRows.apply(group, rank, t), None
        return _GatherRows.apply(group, rank, t.movedim(in_dims[2], 1)), 1  # gathered rows stay dimension 0


def _check(lm_output: Tensor, labels: Tensor, spg_size: int, spg: Any, num_chunk: int) -> int:
    world = sp_world(spg, "FPDT_LogitsLoss")
    if world != spg_size:
        raise ValueError(f"FPDT_LogitsLoss: spg_size={spg_size} but the group has {world} ranks")
    s, b = lm_output.shape[0], lm_output.shape[1]
    if not isinstance(num_chunk, int) or num_chunk <= 0 or s % num_chunk != 0:
        raise ValueError(f"FPDT_LogitsLoss: the local sequence length {s} is not a multiple of num_chunk="
                         f"{num_chunk!r}")
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"FPDT_LogitsLoss: labels must be [batch, local seq] = {(b, s)}, got "
                         f"{tuple(labels.shape)}")
    return world


class _FPDTLogitsLossNode(torch.autograd.Function):
    """FPDT_LogitsLoss's autograd node (see FPDT_LogitsLoss)."""

    @staticmethod
    def forward(ctx: Any, lm_output: Tensor, labels: Tensor, logit_weights: Tensor, rank: int,  # type: ignore[override]
                spg_size: int, spg: Any, num_chunk: int) -> Tensor:
        world = _check(lm_output, labels, spg_size, spg, num_chunk)
        s, b = lm_output.shape[0], lm_output.shape[1]
        c = s // num_chunk
        tgt = labels.t()  # [s, b]
        store = ChunkStore(lm_output.device, offload=lm_output.is_cuda)
        acc = torch.float64 if lm_output.dtype == torch.float64 else torch.float32
        loss = torch.empty(s, b, dtype=acc, device=lm_output.device)
        with torch.no_grad():
            for i in range(num_chunk):
                rows = slice(i * c, (i + 1) * c)
                logits = _chunk_logits(lm_output[rows], logit_weights)
                loss[rows] = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                               tgt[rows].reshape(-1), ignore_index=IGNORE_INDEX,
                                                               reduction="none").view(c, b)
                store.put(i, lm_output[rows].contiguous())
            store.synchronize()
        gathered = torch.empty(s * world, b, dtype=acc, device=loss.device)
        dist.allgather_fn(gathered, loss.contiguous(), group=spg)
        ctx.store, ctx.c, ctx.n, ctx.rank, ctx.dtype = store, c, num_chunk, rank, lm_output.dtype
        ctx.save_for_backward(tgt, logit_weights)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError("FPDT_LogitsLoss: a create_graph backward (autograd.grad(..., create_graph=True) or "
                               "backward(create_graph=True)) is not supported: its chunked backward recomputes the "
                               "logits from detached chunks and cannot return a differentiable gradient; compute the "
                               "loss with plain torch ops for higher-order gradients")
        tgt, weight = ctx.saved_tensors
        store, c, n = ctx.store, ctx.c, ctx.n
        mine = grad[ctx.rank * c * n:(ctx.rank + 1) * c * n]
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        parts = []
        with torch.no_grad():
            for i in range(n):
                if i + 1 < n:
                    store.prefetch(i + 1)
                rows = slice(i * c, (i + 1) * c)
                h = store.get(i)
                g = torch.softmax(_chunk_logits(h, weight), dim=-1)  # d(CE)/d(logits) = softmax - onehot
                t = tgt[rows]
                keep = t != IGNORE_INDEX
                g.scatter_add_(-1, t.clamp(min=0).unsqueeze(-1), -keep.to(g.dtype).unsqueeze(-1))
                g.mul_((mine[rows].to(acc) * keep).unsqueeze(-1))
                parts.append(torch.matmul(g.to(weight.dtype), weight).to(ctx.dtype))
                gw.add_(torch.matmul(g.reshape(-1, g.shape[-1]).t(), h.reshape(-1, h.shape[-1]).to(acc)))
                store.drop(i)
        ctx.store = None
        return torch.cat(parts, dim=0), None, gw.to(weight.dtype), None, None, None, None


class FPDT_LogitsLoss(torch.autograd.Function):
    """FPDT_LogitsLoss.apply(lm_output, labels, logit_weights, rank, spg_size, spg, num_chunk) -> [S, b]."""

    # the work is a separate Function, called by name: torch.compile traces that apply as torch's own (it
    # cannot resolve super().apply from an override)
    @classmethod
    def apply(cls, lm_output: Tensor, labels: Tensor, logit_weights: Tensor, rank: int,  # type: ignore[override]
              spg_size: int, spg: Any, num_chunk: int) -> Tensor:
        if not torch.compiler.is_compiling() and transforms_active():
            _check(lm_output, labels, spg_size, spg, num_chunk)
            logits = _chunk_logits(lm_output, logit_weights)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="none")
            return _GatherRows.apply(spg, rank, loss.view(lm_output.shape[0], lm_output.shape[1]))
        return _FPDTLogitsLossNode.apply(lm_output, labels, logit_weights, rank, spg_size, spg, num_chunk)

