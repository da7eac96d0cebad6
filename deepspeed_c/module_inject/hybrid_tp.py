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

    def _sum_partial(self, t: torch.Tensor) -> torch.Tensor:
        # in place, synchronous: torch runs it on the current stream, so a captured decode step (enable_cuda_graph)
        # records it as one more node of the graph
        _all_reduce(t, group=self.group)
        return t
