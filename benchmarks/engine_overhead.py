"""Per-step overhead of the deepspeed_c engine against a hand-written torch DDP loop.

Both train the same MLP with the same torch SGD on the same data, on N gloo ranks (CPU), in the
same processes, with the same bucket cap (DDP's default 25 MB unless --bucket-elems). The two
loops are first checked to produce the same weights, then timed in interleaved blocks; the script
prints ms/step for each and the ratio.

    python benchmarks/engine_overhead.py --world 2 --steps 30 --reps 5
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def batches(rank: int, n: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(micro, 64, generator=g), torch.randint(0, 10, (micro,), generator=g)) for _ in range(n)]


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed_c

    base = make_model(args.width, args.depth)
    # both sides use the same cap: DDP's default 25 MB in fp32 elements, or --bucket-elems
    bucket_elems = args.bucket_elems
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
              "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_elems}}
    engine, *_ = deepspeed_c.initialize(model=copy.deepcopy(base), config=config)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_elems * 4 / 2**20)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data = batches(rank, args.steps, args.micro)
    loss_fn = torch.nn.CrossEntropyLoss()

    def engine_steps(n: int) -> None:
        for x, y in data[:n]:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()

    def ddp_steps(n: int) -> None:
        for x, y in data[:n]:
            loss = loss_fn(ddp(x), y)
            loss.backward()
            ddp_opt.step()
            ddp_opt.zero_grad(set_to_none=True)

    # correctness before timing: same start, same data, same weights after a few steps
    engine_steps(3)
    ddp_steps(3)
    worst = max(float((a.detach() - b.detach()).norm() / b.detach().norm())
                for a, b in zip(engine.module.parameters(), ddp.module.parameters()))
    if worst > 1e-5:
        raise SystemExit(f"engine and DDP disagree after 3 steps (relative difference {worst:.3g})")

    engine_times, ddp_times = [], []
    for rep in range(args.reps):
        order = [("engine", engine_steps, engine_times), ("ddp", ddp_steps, ddp_times)]
        if rep % 2:
            order.reverse()
        for _, fn, times in order:
            dist.barrier()
            start = time.perf_counter()
            fn(args.steps)
            dist.barrier()
            times.append((time.perf_counter() - start) / args.steps * 1e3)
    n_params = sum(p.numel() for p in base.parameters())
    out.put((rank, {"engine_ms": engine_times, "ddp_ms": ddp_times, "params": n_params, "max_rel_diff": worst,
                    "buckets": engine.reducer.num_buckets if engine.reducer else 0}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-elems", type=int, default=25 * 1024 * 1024 // 4)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    r0 = results[0]
    eng, ddp = statistics.median(r0["engine_ms"]), statistics.median(r0["ddp_ms"])
    print(f"model: MLP {r0['params'] / 1e6:.2f}M params, {args.world} gloo ranks x {args.threads} thread(s), "
          f"micro-batch {args.micro}, {args.steps} steps x {args.reps} interleaved reps")
    print(f"correctness: engine vs DDP after 3 steps, max relative weight difference {r0['max_rel_diff']:.2e}; "
          f"engine buckets: {r0['buckets']}")
    print(f"engine    : {eng:8.3f} ms/step  (reps: {', '.join(f'{t:.3f}' for t in r0['engine_ms'])})")
    print(f"torch DDP : {ddp:8.3f} ms/step  (reps: {', '.join(f'{t:.3f}' for t in r0['ddp_ms'])})")
    print(f"ratio engine/DDP: {eng / ddp:.3f}  (overhead {100 * (eng / ddp - 1):+.1f}%, medians); "
          f"best reps: {min(r0['engine_ms']) / min(r0['ddp_ms']):.3f}")


if __name__ == "__main__":
    main()
