"""Host time of ZeRO-3's forward + backward on CPU, per-module units against automatic units
(runtime/zero/auto_units.py; DSC_Z3_AUTO_UNITS=0 is the per-module baseline), in one run.

A 24-block GPT-like model (examples/train_gpt's GPT) small enough that the arithmetic is a minor part of
the step, so what is measured is mostly the runtime's per-module work: hooks, the autograd identity nodes
that mark each unit's backward, gathers and reduce-scatters. Runs on gloo with `--world` CPU processes
(1 by default; at world 1 the units are views of the shards, so no gathers run and the hooks' own cost is
what differs). Prints, per variant: the median milliseconds of forward, backward and their sum over
`--iters` timed iterations (after `--warmup`; CPU time of the process, one intra-op thread, so other
load on the machine moves it less than wall time), the number of hooked modules (gather steps per forward),
units, the autograd identity nodes in one iteration's graph, and the all-gathers issued per forward and
backward (counted on torch.distributed's ProcessGroup class). Print-only: no assertions.

    .venv/bin/python benchmarks/zero3_host_time.py --world 1
    .venv/bin/python benchmarks/zero3_host_time.py --world 2 --layers 24 --width 64 --persistence 0
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))

GATHERS = ("_allgather_base", "allgather_into_tensor_coalesced", "allgather", "allgather_coalesced")


def _marks(loss: torch.Tensor) -> int:
    """Autograd identity nodes of the ZeRO-3 coordinator (its backward marks) reachable from `loss`."""
    seen, stack, n = set(), [loss.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn.name() in ("_PreBackwardBackward", "_PostBackwardBackward"):
            n += 1
        stack.extend(f for f, _ in fn.next_functions)
    return n


def _variant(args: argparse.Namespace, auto: str, rank: int) -> dict[str, Any]:
    os.environ["DSC_Z3_AUTO_UNITS"] = auto
    from model import GPT, GPTConfig
    from torch._C._distributed_c10d import ProcessGroup

    import deepspeed_c

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                          n_embd=args.width))
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              # DeepSpeed's defaults but the persistence threshold: at this toy width every unit would fall under
              # its 1e5 and stay gathered (no backward marks); 0 makes units come and go as a 1.3B model's do
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": args.persistence}}
    engine, *_ = deepspeed_c.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
    counts = {"fwd": 0, "bwd": 0}
    phase = ["none"]
    originals = {n: getattr(ProcessGroup, n) for n in GATHERS if hasattr(ProcessGroup, n)}

    def counting(orig: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if phase[0] in counts:
                counts[phase[0]] += 1
            return orig(*a, **k)
        return call

    fwd, bwd, marks = [], [], 0
    for it in range(args.warmup + args.iters):
        counted = it == args.warmup  # the first timed iteration follows the plan
        if counted:
            for n, orig in originals.items():
                setattr(ProcessGroup, n, counting(orig))
        t0 = time.process_time()
        phase[0] = "fwd" if counted else "none"
        loss = engine(x, y)
        t1 = time.process_time()
        if counted:
            marks = _marks(loss)
        phase[0] = "bwd" if counted else "none"
        t1b = time.process_time()
        engine.backward(loss)
        t2 = time.process_time()
        phase[0] = "none"
        if counted:
            for n, orig in originals.items():
                setattr(ProcessGroup, n, orig)
        engine.step()
        if it >= args.warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1b) * 1e3)
    coord, store = engine.optimizer.coordinator, engine.optimizer.store
    out = {"fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
           "total_ms": statistics.median(f + b for f, b in zip(fwd, bwd)),
           "hooked_modules": sum(1 for u in coord.units if u), "units": len(store.full), "marks": marks,
           "gathers_fwd": counts["fwd"], "gathers_bwd": counts["bwd"]}
    engine.destroy()
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for r in range(args.rounds):  # interleaved: the variants see the same machine state
        for auto in ("0", "1"):
            rows.append((auto, _variant(args, auto, rank)))
    if rank == 0:
        print(f"GPT {args.layers} blocks, width {args.width}, seq {args.seq}, micro {args.micro}, world {world} "
              f"(gloo, CPU), {args.iters} timed iterations x {args.rounds} rounds")
        print(f"{'units':>10} | {'fwd ms':>8} | {'bwd ms':>8} | {'fwd+bwd ms':>10} | {'hooked':>6} | {'units':>5} | "
              f"{'marks':>5} | {'gathers f/b':>11}")
        for auto, r in rows:
            name = "automatic" if auto == "1" else "per-module"
            print(f"{name:>10} | {r['fwd_ms']:8.2f} | {r['bwd_ms']:8.2f} | {r['total_ms']:10.2f} | "
                  f"{r['hooked_modules']:6d} | {r['units']:5d} | {r['marks']:5d} | "
                  f"{r['gathers_fwd']:>5d}/{r['gathers_bwd']:<5d}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--persistence", type=int, default=0, help="stage3_param_persistence_threshold")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.world == 1:
        _rank(0, 1, port, args)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
