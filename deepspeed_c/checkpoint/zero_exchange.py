"""Moving a partition-shaped tensor between two layouts of the same ranks, point to point.

Given routes (deepspeed_c.ops.partition_route: rows src_rank, src_local, dst_rank, dst_local, length,
identical on every rank), each rank sends the runs of its source partition that another rank owns in
the destination layout and receives the runs it owns there from their holders; runs that stay on a
rank are copied. Nothing is gathered: a rank only ever holds its own source and destination
partitions, plus, when a tensor does not live on the collective device (NCCL takes CUDA tensors only),
staging copies of at most `cap` elements in each direction.

Messages go out in rounds that every rank derives from the same routes, so they match without
negotiation: a round holds at most `cap` elements sent and `cap` received per rank and at most
MAX_MESSAGES messages, and each message is tagged with its index in its round."""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

MAX_MESSAGES = 1024


def _split(rows: torch.Tensor, cap: int) -> torch.Tensor:
    """Runs longer than `cap` cut into pieces of at most `cap` elements."""
    n = rows[:, 4]
    pieces = (n + cap - 1) // cap
    if bool((pieces <= 1).all()):
        return rows
    idx = torch.repeat_interleave(torch.arange(rows.shape[0]), pieces)
    first = torch.cumsum(pieces, 0) - pieces
    off = (torch.arange(idx.numel()) - first[idx]) * cap
    out = rows[idx].clone()
    out[:, 1] += off
    out[:, 3] += off
    out[:, 4] = torch.clamp(n[idx] - off, max=cap)
    return out


def _rounds(rows: list[list[int]], cap: int) -> Iterator[list[list[int]]]:
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    cur: list[list[int]] = []
    for row in rows:
        s, _, d, _, n = row
        if cur and (sent.get(s, 0) + n > cap or recv.get(d, 0) + n > cap or len(cur) >= MAX_MESSAGES):
            yield cur
            cur, sent, recv = [], {}, {}
        cur.append(row)
        sent[s] = sent.get(s, 0) + n
        recv[d] = recv.get(d, 0) + n
    if cur:
        yield cur


def _global_rank(group: Any, r: int) -> int:
    if group is None or group is dist.group.WORLD:
        return r
    return dist.get_global_rank(group, r)


def exchange(routes: torch.Tensor, src: torch.Tensor, out: torch.Tensor, rank: int, group: Any = None,
             cap: int = 1 << 24) -> None:
    """Fill `out` (this rank's partition in the destination layout; elements no route reaches are left
    as they are) from every rank's `src` (this rank's partition in the source layout). Collective over
    `group` when any route crosses ranks; every rank passes the same `routes` and `cap`."""
    if src.dtype != out.dtype:
        raise TypeError(f"exchange: source partition is {src.dtype}, destination {out.dtype}")
    src, out = src.reshape(-1), out.view(-1)
    crossing = routes[:, 0] != routes[:, 2]
    with torch.no_grad():
        for _, a, _, b, n in routes[~crossing & (routes[:, 0] == rank)].tolist():
            out[b:b + n].copy_(src[a:a + n])
        remote = routes[crossing]
        if remote.shape[0] == 0:
            return
        from deepspeed_c.comm import collective_device

        dev = collective_device(group)
        for batch in _rounds(_split(remote, max(1, int(cap))).tolist(), max(1, int(cap))):
            ops, staged = [], []
            for tag, (s, a, d, b, n) in enumerate(batch):
                if s == rank:
                    ops.append(dist.P2POp(dist.isend, src[a:a + n].to(dev), _global_rank(group, d), group, tag))
                elif d == rank:
                    view = out[b:b + n]
                    if view.device != dev:
                        buf = torch.empty(n, dtype=out.dtype, device=dev)
                        staged.append((view, buf))
                        view = buf
                    ops.append(dist.P2POp(dist.irecv, view, _global_rank(group, s), group, tag))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            for view, buf in staged:
                view.copy_(buf)
