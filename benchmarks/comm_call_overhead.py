"""Host cost of one bucket collective call (issue 48): deepspeed_c.comm against torch.distributed's own
functions (what FSDP2 calls) and the bare process-group method both end in, on 2 gloo ranks
(or 2 GPUs over NCCL with --backend nccl).

ZeRO issues a reduce-scatter per gradient bucket and ZeRO-3 an all-gather per parameter fetch, through
deepspeed_c.comm; the time is the enqueue, on the calling thread. Per kind, each rep times --calls calls
of every contender, interleaved (a barrier and the works' waits outside the timed part); printed: the
median rep's main-thread CPU microseconds a call, and the ratio to ours.

  reduce_scatter  1-D fp32 bucket of --numel elements into this rank's chunk, SUM, async
  all_gather      1-D chunk of --numel / 2 elements into the whole, async
  coalesced x8    eight such all-gathers as one collective (ours: all_gather_coalesced; torch: its
                  coalescing manager around eight all_gather_into_tensor)

Correctness first: every contender's outputs are compared with the float64 sum / concatenation.

    .venv/bin/python benchmarks/comm_call_overhead.py [--numel 4096] [--calls 200] [--reps 7] [--backend nccl]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _contenders(n: int, world: int, rank: int, dev: torch.device) -> tuple[dict[str, dict[str, Callable]], tuple]:
    import torch.distributed as dist

    import deepspeed_c.comm as comm

    pg = dist.distributed_c10d._get_default_group()
    rs_opts, ag_opts = dist.ReduceScatterOptions(), dist.distributed_c10d.AllgatherOptions()
    bucket = torch.arange(n, dtype=torch.float32, device=dev) * (rank + 1)
    chunk = torch.empty(n // world, device=dev)
    part = torch.full((n // world,), float(rank), device=dev)
    whole = torch.empty(n, device=dev)
    parts = [part.clone() + k for k in range(8)]
    wholes = [torch.empty(n, device=dev) for _ in range(8)]

    def coalesced_torch() -> list[Any]:
        with dist.distributed_c10d._coalescing_manager(group=None, async_ops=True) as cm:
            for o, i in zip(wholes, parts):
                dist.all_gather_into_tensor(o, i, async_op=True)
        return [cm]

    return {
        "reduce_scatter": {
            "ours": lambda: [comm.reduce_scatter_tensor(chunk, bucket, op=dist.ReduceOp.SUM, group=None, async_op=True)],
            "torch.distributed": lambda: [dist.reduce_scatter_tensor(chunk, bucket, group=None, async_op=True)],
            "process group": lambda: [pg._reduce_scatter_base(chunk, bucket, rs_opts)],
        },
        "all_gather": {
            "ours": lambda: [comm.all_gather_into_tensor(whole, part, group=None, async_op=True)],
            "torch.distributed": lambda: [dist.all_gather_into_tensor(whole, part, group=None, async_op=True)],
            "process group": lambda: [pg._allgather_base(whole, part, ag_opts)],
        },
        "coalesced x8": {
            "ours": lambda: [comm.all_gather_coalesced(wholes, parts, group=None, async_op=True)],
            "torch.distributed": coalesced_torch,
            "process group": lambda: [pg.allgather_into_tensor_coalesced(wholes, parts)],
        },
    }, (bucket, chunk, part, whole, parts, wholes)


def _check(kinds: dict, tensors: tuple, n: int, world: int, rank: int) -> float:
    bucket, chunk, part, whole, parts, wholes = tensors
    full = torch.arange(n, dtype=torch.float64) * sum(r + 1 for r in range(world))
    want_rs = full[rank * (n // world):(rank + 1) * (n // world)]
    want_ag = torch.cat([torch.full((n // world,), float(r), dtype=torch.float64) for r in range(world)])
    worst = 0.0
    for kind, fns in kinds.items():
        for name, fn in fns.items():
            for t in (chunk, whole, *wholes):
                t.fill_(float("nan"))
            for w in fn():
                w.wait()
            got = {"reduce_scatter": [(chunk, want_rs)], "all_gather": [(whole, want_ag)],
                   "coalesced x8": [(o, want_ag + k) for k, o in enumerate(wholes)]}[kind]
            for g, want in got:
                err = (g.double().cpu() - want).abs().max().item()
                if not err == err or err > 1e-3 * max(1.0, want.abs().max().item()):
                    raise SystemExit(f"rank {rank}: {kind} {name} wrong (max error {err})")
                worst = max(worst, err)
    return worst


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    kinds, tensors = _contenders(args.numel, world, rank, dev)
    worst = _check(kinds, tensors, args.numel, world, rank)
    if rank == 0:
        print(f"2 {args.backend} ranks, bucket {args.numel} fp32, {args.calls} calls a rep, {args.reps} reps; "
              f"correctness: every contender's outputs equal the float64 reference (max error {worst:.1e})")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for kind, fns in kinds.items():
            for name, fn in fns.items():
                dist.barrier()
                spent, works = 0.0, []
                for _ in range(args.calls):
                    c0 = time.thread_time()
                    got = fn()
                    spent += time.thread_time() - c0
                    works += got
                    if len(works) >= 16:  # bounded in flight; waits are not timed
                        for w in works:
                            w.wait()
                        works = []
                for w in works:
                    w.wait()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.setdefault((kind, name), []).append(spent * 1e6 / args.calls)
    if rank == 0:
        print(f"{'kind':>15} | {'contender':>17} | {'host us/call':>12} | {'vs ours':>7}")
        for kind, fns in kinds.items():
            ours = statistics.median(times[(kind, "ours")])
            for name in fns:
                t = statistics.median(times[(kind, name)])
                print(f"{kind:>15} | {name:>17} | {t:12.2f} | {t / ours:7.2f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
