"""Megatron-style model parallelism, deepspeed_c against the real DeepSpeed 0.19.8 on the same command
(issue 54): the tests' column/row-parallel GPT with a vocab-parallel embedding tied to the logits
(tests/distributed/megatron_models.py, resized), its own mpu, the same batches, the same config.

Layouts:
  tp-dp  initialize(model=..., mpu=mpu): TP x DP, ZeRO --stage (0-3) over the data-parallel group
  3d     PipelineModule(topology=PipeModelDataParallelTopology(pp, tp, dp)), the embedding tied between
         the first and last stage, ZeRO --stage (0 or 1)

One process per rank (spawned here; NCCL with one GPU each, or gloo on the host with --device cpu).
Both engines live in the same processes: correctness first (the first --check steps' global losses of
the two engines from the same initial weights; bf16 tolerance on GPU; every later step's loss is printed
side by side too), then --blocks interleaved timed
blocks of --steps steps each (synchronised at block ends). Rank 0 prints tokens/s, the median step
time and the ratio deepspeed_c / DeepSpeed. The real DeepSpeed must be importable as `deepspeed` and
not be deepspeed_c's compat alias (e.g. PYTHONPATH=/tmp/ds_real); without it only deepspeed_c runs.

    python benchmarks/megatron_3d.py --layout tp-dp --tp 2 --dp 2 --stage 1
    python benchmarks/megatron_3d.py --layout 3d --pp 2 --tp 2 --dp 1 --stage 1
    python benchmarks/megatron_3d.py --device cpu ...    (small smoke sizes, gloo)
"""
from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.distributed import megatron_models as mm  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["tp-dp", "3d"], default="tp-dp")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--gas", type=int, default=4, help="micro-batches per step (the pipeline's; 1 for tp-dp)")
    ap.add_argument("--blocks", type=int, default=None, help="timed blocks (4; 2 on cpu)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed block (5; 2 on cpu)")
    ap.add_argument("--check", type=int, default=None, help="untimed steps first (3; 2 on cpu)")
    ap.add_argument("--fp32", action="store_true", help="fp32 on the GPU too (no bf16): the engines' algorithms "
                                                        "compared without bf16 rounding noise")
    ap.add_argument("--impl", choices=["both", "deepspeed_c", "deepspeed"], default="both")
    ap.add_argument("--torch_adam", action="store_true",
                    help="torch.optim.Adam on both sides (\"torch_adam\": true; always on the host) instead of the "
                         "fused GPU Adam (DeepSpeed's FusedAdam is JIT-built on first use)")
    args = ap.parse_args()
    if args.layout == "tp-dp":
        args.pp, args.gas = 1, 1
    if args.device == "cpu":  # smoke sizes
        args.hidden, args.heads, args.layers, args.vocab, args.seq, args.micro = 32, 4, 2, 64, 16, 2
    cpu = args.device == "cpu"
    args.blocks = (2 if cpu else 4) if args.blocks is None else args.blocks
    args.steps = (2 if cpu else 5) if args.steps is None else args.steps
    args.check = (2 if cpu else 3) if args.check is None else args.check
    if args.layout == "3d" and args.stage > 1:
        ap.error("--layout 3d runs ZeRO stage 0 or 1 (pipeline parallelism, as DeepSpeed)")
    return args


def config(args: argparse.Namespace) -> dict:
    bf16 = args.device == "cuda" and not args.fp32
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
            "train_batch_size": args.micro * args.gas * args.dp, "steps_per_print": 10**9,
            "gradient_clipping": 1.0, "bf16": {"enabled": bf16}, "zero_optimization": {"stage": args.stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.0,
                                                     "torch_adam": args.device == "cpu" or args.torch_adam}}}


def real_deepspeed() -> Any:
    """The real DeepSpeed module, or None (absent, or deepspeed_c's compat alias)."""
    try:
        import deepspeed
    except ImportError:
        return None
    if "deepspeed_c" in getattr(deepspeed, "__file__", "") or hasattr(deepspeed, "_dsc_alias"):
        return None
    if getattr(deepspeed, "initialize", None) is None or deepspeed.__name__ != "deepspeed":
        return None
    import deepspeed_c

    return None if deepspeed is deepspeed_c else deepspeed


def pipe_model(ds: Any, args: argparse.Namespace, tp: mm.TP) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights for both frameworks
    layers = mm.pipe_layers(ds.pipe, tp)  # the tests' MegatronGPT as stages, embedding tied to the logits
    topology = importlib.import_module(f"{ds.__name__}.runtime.pipe.topology")  # DeepSpeed's path; ours mirrors it
    topo = topology.PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=args.dp)
    return ds.pipe.PipelineModule(layers=layers, topology=topo, loss_fn=mm.pipe_loss, partition_method="uniform",
                                  seed_layers=True, base_seed=1234)


class Runner:
    """One framework's engine and how it takes a step; returns the step's global loss."""

    def __init__(self, ds: Any, args: argparse.Namespace, mpu: mm.MegatronMPU, device: torch.device) -> None:
        self.args, self.mpu, self.device = args, mpu, device
        if args.layout == "3d":
            model = pipe_model(ds, args, mpu.context())
            self.engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config(args))
            self.step: Callable[[list], float] = self._pipe_step
        else:
            model = mm.sharded_model(mpu, seed=0)
            self.engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config(args),
                                            mpu=mpu)
            self.step = self._engine_step

    def _engine_step(self, batch: list) -> float:
        tokens = batch[0]
        d, m = self.mpu.get_data_parallel_rank(), self.args.micro
        loss = self.engine(tokens[d * m:(d + 1) * m].to(self.device))
        self.engine.backward(loss)
        self.engine.step()
        t = loss.detach().float().clone()
        torch.distributed.all_reduce(t, group=self.mpu.get_data_parallel_group())
        return float(t) / self.args.dp

    def _pipe_step(self, batch: list) -> float:
        d, m = self.engine.grid.get_data_parallel_rank(), self.args.micro
        it = iter([(t[d * m:(d + 1) * m, :-1].to(self.device), t[d * m:(d + 1) * m, 1:].to(self.device))
                   for t in batch])
        return float(self.engine.train_batch(it))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import deepspeed_c

    deepspeed_c.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    mm.resize(args.vocab, args.hidden, args.heads, args.seq, args.layers)
    mpu = mm.MegatronMPU(tp=args.tp)  # tensor groups of consecutive ranks: the topology's 'model' axis too
    frameworks = {}
    real = real_deepspeed() if args.impl != "deepspeed_c" else None
    if args.impl != "deepspeed":
        frameworks["deepspeed_c"] = deepspeed_c
    if real is not None:
        real.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")  # its comm layer's state
        frameworks["deepspeed"] = real
    elif rank == 0 and args.impl != "deepspeed_c":
        print("the real DeepSpeed is not importable as `deepspeed` (e.g. PYTHONPATH=/tmp/ds_real): deepspeed_c only")
    runners = {name: Runner(ds, args, mpu, device) for name, ds in frameworks.items()}
    rows = args.micro * args.dp
    total = args.check + args.blocks * args.steps
    batches = [mm.batches(args.gas, rows, seed=100 + i) for i in range(total)]
    losses = {name: [r.step(batches[i]) for i in range(args.check)] for name, r in runners.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for b in range(args.blocks):
        for name, r in runners.items():
            _sync(device)
            t0 = time.perf_counter()
            for s in range(args.steps):
                losses[name].append(r.step(batches[args.check + b * args.steps + s]))
            _sync(device)
            times[name].append((time.perf_counter() - t0) / args.steps)
    if rank == 0:
        report(args, losses, times, device)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def report(args: argparse.Namespace, losses: dict[str, list[float]], times: dict[str, list[float]],
           device: torch.device) -> None:
    """Every step's global loss side by side (the same batches in the same order for both engines), then
    the timings. bf16 on GPU: the two engines round differently, so losses drift apart a little."""
    tokens = args.micro * args.gas * args.dp * args.seq
    print(f"layout={args.layout} pp={args.pp} tp={args.tp} dp={args.dp} zero={args.stage} hidden={args.hidden} "
          f"heads={args.heads} layers={args.layers} vocab={args.vocab} seq={args.seq} micro={args.micro} "
          f"gas={args.gas} device={args.device} torch_adam={args.torch_adam} "
          f"{'bf16' if config(args)['bf16']['enabled'] else 'fp32'}")
    names = list(losses)
    if len(names) == 2:
        tol = 5e-2 if device.type == "cuda" and not args.fp32 else 1e-4
        a, b = losses["deepspeed_c"], losses["deepspeed"]
        print(f"  {'step':>4s} {'deepspeed_c':>12s} {'DeepSpeed':>12s} {'diff':>10s}")
        for i, (x, y) in enumerate(zip(a, b)):
            print(f"  {i:4d} {x:12.5f} {y:12.5f} {x - y:10.2e}{'' if i >= args.check else '  (check)'}")
        first = max(abs(x - y) for x, y in zip(a[:args.check], b[:args.check]))
        every = max(abs(x - y) for x, y in zip(a, b))
        print(f"  losses agree: {first <= tol} (first {args.check} steps max |diff| {first:.2e}, tolerance {tol:g}; "
              f"all {len(a)} steps max |diff| {every:.2e}, max rel {every / max(min(map(abs, b)), 1e-9):.2e})")
    else:
        for name in names:
            print(f"  {name:12s} losses {[round(x, 4) for x in losses[name]]}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(f"  {name:12s} step {t * 1e3:9.2f} ms  {tokens / t:12.0f} tokens/s  (blocks "
              f"{', '.join(f'{x * 1e3:.1f}' for x in times[name])} ms)")
    if len(med) == 2:
        print(f"  deepspeed_c / DeepSpeed tokens/s: {med['deepspeed'] / med['deepspeed_c']:.3f}x")


def main() -> None:
    args = parse()
    world = args.pp * args.tp * args.dp
    if args.device == "cuda" and torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs (pp x tp x dp), {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
