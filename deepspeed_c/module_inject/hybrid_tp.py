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
from torch.distributed import all_reduce as _all_reduce

from deepspeed_c.module_inject.fused_block import BlockSpec, FusedDecoderBlock


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
        self.reducer: Optional["SymmetricAllReduce"] = None  # experimental (use_symmetric_allreduce)

    def _sum_partial(self, t: torch.Tensor) -> torch.Tensor:
        reducer = getattr(self, "reducer", None)
        if reducer is not None and reducer.fits(t):
            return reducer(t)
        # in place, synchronous: torch runs it on the current stream, so a captured decode step (enable_cuda_graph)
        # records it as one more node of the graph
        _all_reduce(t, group=self.group)
        return t


class SymmetricAllReduce:
    """Experimental: a one-shot all-reduce through torch's symmetric memory (CUDA peer access): one kernel copies
    this rank's partial sum into its buffer, waits on the peers' signals and adds every rank's buffer, with no
    NCCL call; for the [batch, hidden] activations of decode steps, where NCCL's per-call latency dominates.
    Capturable in a CUDA graph. Tensors larger than the buffer (prefill) keep NCCL."""

    def __init__(self, group: Any, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm

        self.group_name = group.group_name  # torch >= 2.9 needs no enable_symm_mem_for_group
        self.buffer = symm.empty(numel, dtype=dtype, device=device)
        symm.rendezvous(self.buffer, group)  # collective over the group

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_cuda and t.dtype == self.buffer.dtype and t.numel() <= self.buffer.numel() and t.is_contiguous()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[:t.numel()].view_as(t), t, "sum",
                                                        self.group_name, out)
        return out


def use_symmetric_allreduce(model: torch.nn.Module, tokens: int = 1) -> int:
    """Experimental, opt-in: the tensor-parallel fused blocks of `model` reduce activations of up to `tokens`
    rows through one SymmetricAllReduce (collective: every rank of the group calls it); tokens=0 goes back to
    NCCL. Captured decode graphs are dropped (they hold the previous all-reduces). Returns the blocks routed."""
    blocks = [m for m in model.modules() if isinstance(m, TPFusedDecoderBlock) and m.group is not None]
    if not blocks:
        return 0
    if tokens < 0:
        raise ValueError(f"use_symmetric_allreduce: tokens must be >= 0, got {tokens}")
    reducer = None
    if tokens:
        first = blocks[0]  # activations: [tokens, hidden] in the norms' dtype
        reducer = SymmetricAllReduce(first.group, tokens * first.spec.hidden, first.ln1_w.dtype, first.ln1_w.device)
    for b in blocks:
        b.reducer = reducer
    for m in model.modules():
        graphs = getattr(m, "_graphs", None)
        if isinstance(graphs, dict):
            graphs.clear()
    return len(blocks)
