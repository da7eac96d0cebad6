"""Pipeline schedules side by side: 1F1B (DeepSpeed's TrainSchedule), interleaved 1F1B and ZB-H1.

Part 1 (always): the bubble fraction of each schedule, from the C core's simulator
(csrc/core/pipe_schedule.c: every stage's instruction stream run together, forward 1 unit,
backward 2, split backward 1 + 1, chunks 1/V of that). Correctness first: the simulated 1F1B
bubble must equal the closed form (S - 1) / (M + S - 1).

Part 2 (--measure): the same model trained by the three schedules in the same processes (S ranks,
NCCL when S GPUs are visible, else gloo on CPU). Correctness first: the first batch's losses of
the three engines agree; then interleaved repetitions of train_batch, median ms per batch and the
ratio to 1F1B.

    python benchmarks/pipeline_bubble.py
    python benchmarks/pipeline_bubble.py --measure --stages 4 --micro-batches 16 --hidden 4096 --layers 32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bubble_table(stage_list: list[int], mb_list: list[int]) -> None:
    from deepspeed_c.runtime.pipe.schedule import (KIND_INTERLEAVED, KIND_TRAIN, KIND_ZB_H1, bubble_fraction)

    print("Simulated bubble fraction (idle share of stages x time); ratio = schedule / 1F1B")
    print(f"| stages | micro-batches | 1F1B | interleaved v=2 | interleaved v=4 | ZB-H1 |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in stage_list:
        for m in mb_list:
            base = bubble_fraction(KIND_TRAIN, m, s, 1)
            closed = (s - 1) / (m + s - 1)
            assert abs(base - closed) < 1e-12, f"1F1B simulation {base} != closed form {closed} at S={s}, M={m}"
            cells = []
            for kind, v in ((KIND_INTERLEAVED, 2), (KIND_INTERLEAVED, 4), (KIND_ZB_H1, 1)):
                if kind == KIND_INTERLEAVED and m % s:
                    cells.append("n/a (M % S != 0)")
                    continue
                b = bubble_fraction(kind, m, s, v)
                cells.append(f"{b:.3f} ({b / base:.2f}x)")
            print(f"| {s} | {m} | {base:.3f} | " + " | ".join(cells) + " |")


# -- measured -------------------------------------------------------------------------------------
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb_h1", 1))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    import deepspeed_c as deepspeed
    from deepspeed_c.pipe import LayerSpec, PipelineModule

    layers = []
    for _ in range(args.layers):
        layers += [LayerSpec(torch.nn.Linear, args.hidden, args.hidden), LayerSpec(torch.nn.GELU)]
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.micro_batch_size, args.hidden, generator=gen),
             torch.randn(args.micro_batch_size, args.hidden, generator=gen)) for _ in range(args.micro_batches)]
    engines = []
    for name, v in SCHEDULES:
        model = PipelineModule(layers, num_stages=world, loss_fn=torch.nn.functional.mse_loss, seed_layers=True,
                               partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch_size,
               "gradient_accumulation_steps": args.micro_batches, "gradient_clipping": 0.0,
               "bf16": {"enabled": use_cuda}, "pipeline": {"schedule": name, "virtual_stages": v},
               "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4))
        engines.append(engine)
    first = [float(e.train_batch(iter(data))) for e in engines]
    times = {name: [] for name, _ in SCHEDULES}
    for _ in range(args.reps):
        for (name, _), e in zip(SCHEDULES, engines):
            dist.barrier()
            if use_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.train_batch(iter(data))
            if use_cuda:
                torch.cuda.synchronize()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        queue.put({"first": first, "times": times, "device": "cuda/nccl" if use_cuda else "cpu/gloo"})
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.stages, port, args, queue)) for r in range(args.stages)]
    for p in procs:
        p.start()
    out = queue.get(timeout=3600)
    for p in procs:
        p.join()
    first = out["first"]
    for (name, _), loss in zip(SCHEDULES, first):
        rel = abs(loss - first[0]) / max(abs(first[0]), 1e-12)
        assert rel < 1e-2, f"{name}'s first-batch loss {loss} differs from 1F1B's {first[0]}"
    print(f"\nMeasured on {args.stages} ranks ({out['device']}): {args.layers} x Linear({args.hidden}) + GELU, "
          f"{args.micro_batches} micro-batches of {args.micro_batch_size}; first-batch losses "
          + ", ".join(f"{n}={l:.6f}" for (n, _), l in zip(SCHEDULES, first)))
    base = statistics.median(out["times"]["1f1b"])
    print("| schedule | ms/batch (median) | speed vs 1F1B | reps (ms) |")
    print("| --- | ---: | ---: | --- |")
    for name, _ in SCHEDULES:
        t = out["times"][name]
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.1f} | {base / med:.2f}x | " + ", ".join(f"{x * 1e3:.0f}" for x in t) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="also time the three schedules on real ranks")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    bubble_table([2, 4, 8], [4, 8, 16, 32])
    if args.measure:
        measure(args)


if __name__ == "__main__":
    main()
