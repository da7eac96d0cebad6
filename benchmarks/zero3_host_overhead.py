"""ZeRO-3's host overhead per training step on CPU: our stage-3 engine against FSDP2, side by side in the
same two gloo ranks (issue 48: the GPU step is partly host-bound, and this measures that host part).

The model is many tiny layers (by default 48 blocks of four Linear(64, 64) with ReLU, batch 4 a rank), so
the arithmetic is a small part of a step and what is timed is each runtime's per-step bookkeeping: module
hooks, autograd marks, the fetch planner, gathers, bucket bookkeeping, the optimizer step. Both systems
train fp32 with AdamW (lr 1e-3, weight decay 0.01) from the same starting weights on the same per-rank
batches:

  ours   deepspeed_c.initialize with a DeepSpeed JSON: ZeRO stage 3, DeepSpeed's defaults except
         stage3_param_persistence_threshold 0 (every parameter partitioned, gathered and released each use),
         gradient_clipping 0 (as the FSDP2 loop)
  fsdp2  torch.distributed.fsdp.fully_shard per block, then the root; torch.optim.AdamW

Correctness first: the first --check steps' losses of both, printed in full (float.hex, for bit-identity
checks of our runtime before/after a change) and compared (relative difference <= 1e-5, fp32 reduction
order). Then --reps interleaved blocks of --steps whole steps (forward, backward, optimizer step) each, a
barrier before each block; per system, on rank 0, the median block's wall ms/step and its host ms/step: CPU
time of the main thread (Python hooks, autograd, bookkeeping, enqueuing collectives; not gloo's threads nor
time spent waiting), the part of a step that is host overhead on a GPU.

--profile: after the timing, cProfile of --steps of our steps on rank 0, the top functions by cumulative and
by own time.

    .venv/bin/python benchmarks/zero3_host_overhead.py [--blocks 48] [--width 64] [--batch 4] [--reps 5]
                                                        [--steps 10] [--check 3] [--profile [--dump F]]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LR, WD = 1e-3, 0.01


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for fc in self.fc:
            h = torch.relu(fc(h))
        return x + h


class Net(torch.nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _ours(model: torch.nn.Module, args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], float]:
    import deepspeed_c

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "gradient_clipping": 0.0,  # FSDP2's loop clips nothing either
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed_c.initialize(model=model, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    step.engine = engine  # type: ignore[attr-defined]
    return step


def _fsdp2(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], float]:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _timed(step: Callable, batches: list, n: int) -> tuple[float, float]:
    """(wall ms, main-thread CPU ms) per step over n steps."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    for k in range(n):
        step(*batches[k % len(batches)])
    return (time.perf_counter() - t0) * 1e3 / n, (time.thread_time() - c0) * 1e3 / n


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = Net(args.blocks, args.width)
    ref = copy.deepcopy(base)  # before ours partitions `base` in place
    ours, fsdp = _ours(base, args), _fsdp2(ref)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
               for _ in range(8)]
    # correctness first: the same steps on the same batches
    lo = [ours(*batches[k % 8]) for k in range(args.check)]
    lf = [fsdp(*batches[k % 8]) for k in range(args.check)]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(lo, lf))
    if rank == 0:
        print(f"{args.blocks} blocks x 4 Linear({args.width},{args.width}), batch {args.batch} a rank, world {world} "
              f"(gloo, CPU, fp32, 1 intra-op thread), {sum(p.numel() for p in ref.parameters()) * world:,} params")
        print("ours  losses:", " ".join(float(v).hex() for v in lo), f"({', '.join(f'{v:.9g}' for v in lo)})")
        print("fsdp2 losses:", " ".join(float(v).hex() for v in lf), f"({', '.join(f'{v:.9g}' for v in lf)})")
        print(f"check: max relative difference {worst:.2e} ({'ok' if worst <= 1e-5 else 'MISMATCH'})", flush=True)
    if worst > 1e-5:
        dist.destroy_process_group()
        raise SystemExit(f"rank {rank}: losses differ by {worst:.2e} relative: not timed")
    _timed(ours, batches, 2)  # warm both past their first-step work
    _timed(fsdp, batches, 2)
    to, tf = [], []
    for r in range(args.reps):
        to.append(_timed(ours, batches, args.steps))
        tf.append(_timed(fsdp, batches, args.steps))
    if rank == 0 and args.reps:
        print("wall: ms/step; host: CPU ms/step of the main thread (hooks, autograd, enqueuing; not gloo's threads "
              "nor waits)")
        print(f"{'rep':>4} | {'ours wall':>9} | {'fsdp2 wall':>10} | {'ratio':>5} | {'ours host':>9} | "
              f"{'fsdp2 host':>10} | {'ratio':>5}")
        rows = [(a[0], b[0], a[1], b[1]) for a, b in zip(to, tf)]
        for r, (wo, wf, ho, hf) in enumerate(rows):
            print(f"{r:4d} | {wo:9.2f} | {wf:10.2f} | {wf / wo:5.2f} | {ho:9.2f} | {hf:10.2f} | {hf / ho:5.2f}")
        wo, wf, ho, hf = (statistics.median(c) for c in zip(*rows))
        print(f"{'med':>4} | {wo:9.2f} | {wf:10.2f} | {wf / wo:5.2f} | {ho:9.2f} | {hf:10.2f} | {hf / ho:5.2f}"
              "  (ratio fsdp2/ours: >1 ours faster)", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for k in range(args.steps):
            ours(*batches[k % 8])
        prof.disable()
        if rank == 0:
            stats = pstats.Stats(prof)
            if args.dump:
                stats.dump_stats(args.dump)
            print(f"-- ours, {args.steps} steps profiled: {stats.total_calls / args.steps:.0f} Python function calls "
                  f"a step ({stats.prim_calls / args.steps:.0f} primitive), {stats.total_tt * 1e3 / args.steps:.1f} "
                  "ms a step under the profiler")
            for key in args.sort.split(","):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
                print(f"-- ours, {args.steps} steps, by {key}")
                print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()), flush=True)
    ours.engine.destroy()  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--check", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=30, help="rows of each profile table")
    ap.add_argument("--dump", default="", help="--profile: also write rank 0's pstats to this file")
    ap.add_argument("--sort", default="cumulative,tottime", help="pstats sort keys of the profile tables (ncalls, ...)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
