"""MiCS (`zero_optimization.mics_shard_size`) against plain ZeRO-3 on N ranks: same losses, fewer bytes between
shard groups, step time.

Both systems train the same GPT-like stack from the same seed on the same batches (fp32, gradient accumulation,
clipping, AdamW). Correctness first: the losses of every step agree within 1e-4 relative (fp32 sums in another
order: MiCS reduce-scatters inside the shard group, then all-reduces across). Then, per rank and per step,
the bytes of every collective counted as it is issued (deepspeed_c.comm wrapped for the run; the comms logger is
on so ZeRO-3's unit gathers go through it) and split by where they come from: a rank's "node" is its block of
mics_shard_size consecutive ranks (MiCS's shard group); for an all-gather it receives chunk x (peers outside the
block), for a reduce-scatter input/|G| x (peers outside), for an all-reduce twice that (reduce-scatter +
all-gather). DeepSpeed 0.19.8 removed MiCS (its issue 8489), so there is no competitor to run beside it.

  python benchmarks/mics.py --nprocs 4 --shard 2                 # gloo on CPU ranks, tiny
  python benchmarks/mics.py --nprocs 4 --shard 2 --backend nccl --layers 8 --d 1024   # one GPU a rank"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: deepspeed_c


class Net(torch.nn.Module):
    def __init__(self, layers: int, d: int, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d),
                                                              torch.nn.GELU(), torch.nn.Linear(4 * d, d))
                                          for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class Bytes:
    """deepspeed_c.comm's collectives wrapped: bytes this rank receives from inside / outside its block."""

    OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

    def __init__(self, block: int) -> None:
        import torch.distributed as dist

        import deepspeed_c.comm as comm

        self.comm, self.me, self.block = comm, dist.get_rank(), block
        self.inside = self.outside = 0
        self.counting = False
        self._saved = {name: getattr(comm, name) for name in self.OPS}
        for name, fn in self._saved.items():
            setattr(comm, name, self._wrap(name, fn))

    def _peers(self, group: Any) -> tuple[int, int]:
        import torch.distributed as dist

        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        mine = self.me // self.block
        outside = sum(1 for r in ranks if r // self.block != mine)
        return len(ranks) - 1 - outside, outside

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                group = kwargs.get("group")
                inside, outside = self._peers(group)
                if name == "all_gather_into_tensor":
                    t = args[1] if len(args) > 1 else kwargs["tensor"]
                    per = t.numel() * t.element_size()
                elif name == "reduce_scatter_tensor":
                    t = args[1] if len(args) > 1 else kwargs["input_tensor"]
                    per = t.numel() * t.element_size() // (inside + outside + 1)
                else:
                    t = args[0] if args else kwargs["tensor"]
                    per = 2 * t.numel() * t.element_size() // (inside + outside + 1)
                self.inside += per * inside
                self.outside += per * outside
            return fn(*args, **kwargs)

        return counted

    def restore(self) -> None:
        for name, fn in self._saved.items():
            setattr(self.comm, name, fn)


def _run(rank: int, args: Any, system: str, counter: Bytes) -> dict[str, Any]:
    import deepspeed_c

    dev = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = Net(args.layers, args.d, args.vocab)
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if system == "mics":
        zero["mics_shard_size"] = args.shard
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "comms_logger": {"enabled": True}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        counter.counting = step >= args.warmup
        if step == args.warmup:
            counter.inside = counter.outside = 0
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for micro in range(args.gas):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            ids = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g).to(dev)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            if micro == 0:
                losses.append(float(loss.detach()))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    counter.counting = False
    out = {"losses": losses, "step_s": statistics.median(times), "inside": counter.inside / args.steps,
           "outside": counter.outside / args.steps}
    engine.destroy()
    return out


def _rank_main(rank: int, args: Any, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.nprocs), LOCAL_WORLD_SIZE=str(args.nprocs))
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=args.nprocs)
    counter = Bytes(args.shard)
    results = {}
    order = ("zero3", "mics")
    for system in order:
        results[system] = _run(rank, args, system, counter)
    counter.restore()
    every: list[Any] = [None] * args.nprocs
    dist.all_gather_object(every, results)
    if rank == 0:
        _report(args, every)
    dist.destroy_process_group()


def _report(args: Any, every: list[dict[str, Any]]) -> None:
    z, m = every[0]["zero3"]["losses"], every[0]["mics"]["losses"]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(z, m))
    ok = worst <= 1e-4
    print(f"== correctness: {args.nprocs} ranks, mics_shard_size {args.shard}: {len(z)} steps' losses vs ZeRO-3, "
          f"worst relative difference {worst:.2e} ({'OK' if ok else 'FAIL'}, tolerance 1e-4) ==")

    def avg(system: str, key: str) -> float:
        return sum(r[system][key] for r in every) / len(every)

    print(f"== per rank and step (median step, mean bytes over ranks; block = {args.shard} consecutive ranks) ==")
    print(f"{'':26s} {'ZeRO-3':>12s} {'MiCS':>12s} {'ZeRO-3/MiCS':>12s}")
    for key, label, unit in (("outside", "bytes from other blocks", 1e6), ("inside", "bytes inside the block", 1e6)):
        a, b = avg("zero3", key) / unit, avg("mics", key) / unit
        print(f"{label + ' MB':26s} {a:12.2f} {b:12.2f} {a / b if b else float('inf'):11.2f}x")
    a, b = avg("zero3", "step_s") * 1e3, avg("mics", "step_s") * 1e3
    print(f"{'step ms':26s} {a:12.2f} {b:12.2f} {a / b:11.2f}x")
    print("DeepSpeed 0.19.8: no MiCS (removed, issue 8489); nothing to run side by side")
    if not ok:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--shard", type=int, default=2)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.nprocs % args.shard != 0 or args.shard >= args.nprocs:
        raise SystemExit("--shard must divide --nprocs and be smaller (MiCS needs more than one shard group)")
    if args.backend == "nccl" and torch.cuda.device_count() < args.nprocs:
        raise SystemExit(f"--backend nccl needs {args.nprocs} GPUs, {torch.cuda.device_count()} visible")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(args, port), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
