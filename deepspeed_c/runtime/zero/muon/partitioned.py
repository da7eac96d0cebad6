"""Muon over a ZeRO partition (stages 1, 2 and 3).

Under ZeRO the optimizer steps one flat partition per param group (PartitionPlan, runtime layout: rank r
owns chunk r of every bucket), so a weight matrix is cut across ranks, while Newton-Schulz needs the whole
matrix. Momentum and the Nesterov blend are elementwise and stay partitioned (no full-size state on any
rank). Only the blended update travels, and only to one rank per matrix:

1. every matrix is given to one rank (largest first onto the least loaded rank, by Newton-Schulz FLOPs),
2. one all-to-all sends each rank's slices of a matrix to that matrix's rank, which assembles it whole,
3. each rank orthogonalises its matrices (batched by shape, newton_schulz.orthogonalize_many),
4. the reverse all-to-all returns every slice to the rank whose partition holds it.

So each rank sends and receives about one partition's worth of elements twice per step, and the
Newton-Schulz work is split W ways (DeepSpeed 0.19.8 instead all-reduces the whole gradient of every
matrix its partition touches and orthogonalises it on each of those ranks).

The exchange plan (index tensors, split sizes) is built once per group from the plan's slice table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from deepspeed_c.runtime.zero.muon.newton_schulz import NS_STEPS, matrix_view_shape, orthogonalize_many


def _ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz FLOPs up to a constant: batch x short^2 x long."""
    rows, cols = shape[-2], shape[-1]
    batch = int(torch.Size(shape[:-2]).numel()) if len(shape) > 2 else 1
    short, long_ = min(rows, cols), max(rows, cols)
    return batch * short * short * (long_ + short)


def assign_matrices(shapes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Rank of each matrix: longest-processing-time greedy (largest first, onto the least loaded rank, ties
    to the lower rank and index). Deterministic, so every rank computes the same table."""
    load = [0] * world_size
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda k: (-_ns_cost(shapes[k]), k)):
        r = min(range(world_size), key=lambda q: (load[q], q))
        owner[i] = r
        load[r] += _ns_cost(shapes[i])
    return owner


@dataclass(frozen=True)
class PartitionLayout:
    """How a ZeRO optimizer cut one param group: what a partition-aware optimizer needs to find the pieces of
    each parameter. shapes: each parameter's whole shape in plan order; slices: the plan's runtime slice table
    rows (param, rank, param_start, local_start, length, ...); group: the data-parallel process group."""

    shapes: tuple[tuple[int, ...], ...]
    expert: tuple[bool, ...]
    rank: int
    world_size: int
    group: Any
    slices: tuple[tuple[int, ...], ...]


@dataclass
class PartitionedMuon:
    """One param group's exchange plan. shapes: each parameter's whole shape in plan order; slices: the plan's
    runtime slice table rows (param, rank, param_start, local_start, length, ...)."""

    shapes: list[tuple[int, ...]]
    expert: list[bool]
    rank: int
    world_size: int
    group: Any
    device: torch.device
    slices: list[tuple[int, ...]]

    @classmethod
    def from_layout(cls, layout: PartitionLayout, device: torch.device) -> "PartitionedMuon":
        return cls(shapes=list(layout.shapes), expert=list(layout.expert), rank=layout.rank,
                   world_size=layout.world_size, group=layout.group, device=device, slices=list(layout.slices))

    def __post_init__(self) -> None:
        for shape in self.shapes:
            if len(matrix_view_shape(shape)) < 2:
                raise ValueError(f"a use_muon param group holds a parameter of shape {tuple(shape)}; Muon needs "
                                 f"ndim >= 2 (put it in a use_muon=False group)")
        self.owner = assign_matrices([matrix_view_shape(s, e) for s, e in zip(self.shapes, self.expert)],
                                     self.world_size)
        numel = [int(torch.Size(s).numel()) for s in self.shapes]
        self.owned = [i for i in range(len(self.shapes)) if self.owner[i] == self.rank]
        offsets, at = {}, 0
        for i in self.owned:
            offsets[i] = at
            at += numel[i]
        self.owned_numel = at
        rows = sorted(self.slices, key=lambda s: (self.owner[s[0]], s[1], s[0], s[2]))
        mine = [s for s in rows if s[1] == self.rank]  # what this rank sends: by destination, param, offset
        incoming = [s for s in rows if self.owner[s[0]] == self.rank]  # what it receives: by source, param, offset
        self.send_splits = [sum(s[4] for s in mine if self.owner[s[0]] == r) for r in range(self.world_size)]
        self.recv_splits = [sum(s[4] for s in incoming if s[1] == r) for r in range(self.world_size)]
        # Each step is one torch.cat over (start, length) pieces: a few thousand views, no per-element index
        # tensors (those would take twice the masters' memory).
        self._send = [(s[3], s[4]) for s in mine]
        at_recv = _starts([s[4] for s in incoming])
        order = sorted(range(len(incoming)), key=lambda k: (incoming[k][0], incoming[k][2]))
        covered = [s[2] for s in (incoming[k] for k in order)]
        expect = [p for i in self.owned for p in _starts([s[4] for s in sorted(
            (r for r in incoming if r[0] == i), key=lambda r: r[2])])]
        if covered != expect or sum(s[4] for s in incoming) != self.owned_numel:
            raise ValueError("the partition's slices do not tile each parameter exactly once")
        self._assemble = [(at_recv[k], incoming[k][4]) for k in order]
        self._give_back = [(offsets[s[0]] + s[2], s[4]) for s in incoming]
        at_back = _starts([s[4] for s in mine])
        self._place: list[tuple[Optional[int], int]] = []  # (start in the returned buffer | None for zeros, length)
        end = 0
        for k in sorted(range(len(mine)), key=lambda k: mine[k][3]):
            local_start, length = mine[k][3], mine[k][4]
            if local_start > end:
                self._place.append((None, local_start - end))
            self._place.append((at_back[k], length))
            end = local_start + length
        self._placed_end = end

    def _exchange(self, send: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.world_size == 1:
            return send
        import deepspeed_c.comm as dist

        recv = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=self.group)
        return recv

    @torch.no_grad()
    def orthogonalize(self, local: torch.Tensor, ns_method: str, steps: int = NS_STEPS) -> torch.Tensor:
        """This rank's partition of Muon's update: `local` is its partition of the momentum-blended gradient
        (padding ignored); the result has local's size, dtype and device, zero on the padding. A collective:
        every rank of the group calls it for the same group in the same order."""
        flat = local.view(-1)
        received = self._exchange(_pieces(flat, self._send), self.recv_splits, self.send_splits)
        whole = _pieces(received, self._assemble)
        views, at = [], 0
        for i in self.owned:
            n = int(torch.Size(self.shapes[i]).numel())
            views.append(whole[at:at + n].view(self.shapes[i]))
            at += n
        ortho = orthogonalize_many(views, [self.shapes[i] for i in self.owned], ns_method, steps,
                                   expert=[self.expert[i] for i in self.owned])
        done = torch.cat([o.reshape(-1) for o in ortho]) if ortho else whole
        returned = self._exchange(_pieces(done, self._give_back), self.send_splits, self.recv_splits)
        tail = flat.numel() - self._placed_end
        gaps = [n for start, n in self._place if start is None] + [tail]
        zeros = torch.zeros(max(gaps), dtype=flat.dtype, device=flat.device)
        parts = [returned.narrow(0, start, n) if start is not None else zeros[:n] for start, n in self._place]
        if tail:
            parts.append(zeros[:tail])
        return torch.cat(parts).view_as(local) if parts else torch.zeros_like(local)


def _starts(lengths: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _pieces(src: torch.Tensor, pieces: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The (start, length) pieces of the flat tensor src, concatenated in order."""
    if not pieces:
        return src.new_empty(0)
    return torch.cat([src.narrow(0, start, n) for start, n in pieces])


def layout_from_zero_owner(model_params: Sequence[torch.Tensor], flat: torch.Tensor) -> Optional[PartitionLayout]:
    """The layout of the ZeRO partition `flat`, found through the owner record a ZeRO stage 1/2/3 optimizer
    leaves on each trainable parameter it partitions (model_params: the parameters the Muon optimizer was built
    over; an owner may be one member of MoE's composite, with the member's process group). Reads only the
    owner's public faces: partition_plans, bit16_groups, fp32_partitions, rank, world_size, dp_process_group.
    None when no ZeRO optimizer holds `flat`."""
    from deepspeed_c.runtime.zero.stage_1_and_2 import OWNER_ATTR

    seen: set[int] = set()
    for p in model_params:
        entry = getattr(p, OWNER_ATTR, None)
        owner = entry[0]() if entry is not None else None
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        for g, master in enumerate(owner.fp32_partitions):
            if master is flat:
                params = owner.bit16_groups[g]
                return PartitionLayout(shapes=tuple(tuple(getattr(q, "ds_shape", q.shape)) for q in params),
                                       expert=tuple(bool(getattr(q, "is_expert_group", False)) for q in params),
                                       rank=owner.rank, world_size=owner.world_size, group=owner.dp_process_group,
                                       slices=tuple(owner.partition_plans[g].slices("runtime")))
    return None
