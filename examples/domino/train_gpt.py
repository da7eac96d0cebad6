"""Train a GPT whose tensor-parallel all-reduces Domino hides behind computation.

    python examples/domino/train_gpt.py --tp 2              # spawns 2 ranks (NCCL on GPUs, else gloo on CPU)
    python examples/domino/train_gpt.py --tp 4 --dp 1
    python examples/domino/train_gpt.py --tp 2 --dp 2       # ZeRO-1 over the data-parallel pairs
    deepspeed --num_gpus 2 examples/domino/train_gpt.py --tp 2   # or torchrun: ranks already launched

The data is synthetic and learnable (each sequence counts up from a random start, modulo the vocabulary),
so the loss falls within a few dozen steps. The mpu is deepspeed's PipelineParallelGrid over
(pipe 1, data dp, model tp): tensor-parallel ranks consecutive; the engine reduces gradients and
partitions ZeRO's optimizer state over the data-parallel groups only."""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--size", choices=sorted(gpt.SIZES), default="tiny")
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per data-parallel rank (even: Domino halves it)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--intra", action="store_true", help="intra-layer overlap (default: across layer boundaries)")
    ap.add_argument("--recompute", action="store_true", help="activation recomputation between the all-reduces")
    ap.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's argument
    return ap.parse_args()


def batch(step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    return (start + torch.arange(seq + 1)) % vocab


def train(args: argparse.Namespace) -> None:
    import deepspeed_c
    from deepspeed_c.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed_c.init_distributed(dist_backend="nccl" if cuda else "gloo")
    world = torch.distributed.get_world_size()
    if world != args.tp * args.dp:
        raise ValueError(f"--tp {args.tp} x --dp {args.dp} = {args.tp * args.dp}, but {world} ranks were launched")
    mpu = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=args.tp, num_dp=args.dp))
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)  # every rank draws the same replicated weights (and the same shards' initial values)
    config = gpt.domino_config(args.size, dtype, domino_intra_layer_overlap=args.intra,
                               recompute_granularity="full" if args.recompute else None)
    model = gpt.GPT(config, mpu, args.vocab, args.seq)
    ds_config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                 "steps_per_print": 10**9, "gradient_clipping": 1.0,
                 "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.0}},
                 "zero_optimization": {"stage": args.zero}, "bf16": {"enabled": dtype == torch.bfloat16}}
    engine, *_ = deepspeed_c.initialize(model=model, config=ds_config, mpu=mpu)
    dp_rank, device = mpu.get_data_parallel_rank(), next(engine.module.parameters()).device
    for step in range(args.steps):
        rows = slice(dp_rank * args.micro, (dp_rank + 1) * args.micro)  # this data-parallel rank's share
        tokens = batch(step, args.micro * args.dp, args.seq, args.vocab)[rows].to(device)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if torch.distributed.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    train(args)


def main() -> None:
    args = parse()
    if "RANK" in os.environ:  # launched by deepspeed / torchrun
        train(args)
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = args.tp * args.dp
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        sys.exit(f"needs {world} GPUs (tp x dp), {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
