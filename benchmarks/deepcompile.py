"""DeepCompile side by side: the same GPT (examples/train_gpt), the same JSON config and the same batches on
every rank, trained by

  dsc-eager   deepspeed_c ZeRO-3, eager (the anchor: every ratio is against it)
  dsc-dc      deepspeed_c ZeRO-3 with compile.deepcompile + engine.compile(backend="inductor")
  dsc-dc-nb   the same, each graph scheduled on its own (no unit kept or prefetched across the
              forward/backward boundary: zero3_compile.ACROSS_BOUNDARY off while it compiles and runs)
  ds-eager    DeepSpeed 0.19.x ZeRO-3, eager            (when the real DeepSpeed is importable as `deepspeed`)
  ds-dc       DeepSpeed 0.19.x DeepCompile ZeRO-3        (same)
  fsdp2       torch FSDP2: fully_shard per block + root, bf16 compute, fp32 reduce, fp32 sharded masters,
              torch AdamW(fused on GPU), clip_grad_norm_
  fsdp2-tc    the same fully-sharded model run through torch.compile (inductor)

Config (every DeepSpeed-style engine): bf16, AdamW lr 1e-4 wd 0.01, gradient_clipping 1.0, ZeRO stage 3
with DeepSpeed's defaults, micro batch --micro, no accumulation.

Correctness first: each engine's losses over the first --check steps are compared with dsc-eager's
(relative difference <= 2e-2, bf16 tolerance); an engine that disagrees is reported and not timed. Compile
time: the untimed steps' time minus as many median timed steps (our compiled engines compile in their
first step; DeepSpeed's DeepCompile compiles at its first step and again at its step 5 with its prefetch
and selective-gather passes, so it runs 7 more untimed steps than --warmup asks). Then --blocks rounds
of interleaved timed blocks (each engine --steps whole steps per block, engines in turn, synchronised
at block ends): median ms/step, tokens/s (all ranks), the ratio to dsc-eager, and the peak device memory
of the engine's blocks above what was allocated when its block began, plus what it holds once set up
(parameters, gradients, optimizer states). Rank 0 prints a table and, with --json, writes the figures
there.

All engines stay resident together (interleaving needs them at once): at the default 1.3B on 4 H200s each
holds ~5-6 GiB per GPU. --engines picks a subset.

    torchrun --nproc_per_node 4 benchmarks/deepcompile.py [--n_embd 2048 --n_layer 24 --n_head 16]
             [--seq 2048] [--micro 1] [--engines dsc-eager,dsc-dc,ds-eager,ds-dc,fsdp2,fsdp2-tc]
             [--check 3] [--blocks 3] [--steps 5] [--json out.json]
    python benchmarks/deepcompile.py --tiny        # CPU smoke: 2 gloo ranks, a tiny GPT, figures mean nothing
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "train_gpt"))

ALL = ("dsc-eager", "dsc-dc", "ds-eager", "ds-dc", "fsdp2", "fsdp2-tc")  # and dsc-dc-nb (A/B, not in the default)
DS_WARMUP = 5  # DeepSpeed 0.19's deepspeed/compile/init_z3.py WARMUP: the step its full pass schedule starts


def ds_config(micro: int, deepcompile: bool) -> dict:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                           "steps_per_print": 10**9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
                           "zero_optimization": {"stage": 3}, "wall_clock_breakdown": False}
    if deepcompile:
        cfg["compile"] = {"deepcompile": True}
    return cfg


class Engine:
    """One engine's step on a batch, with the process-wide state it needs around it."""

    def __init__(self, name: str, step: Callable[[torch.Tensor, torch.Tensor], float],
                 around: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.name, self._step, self.around = name, step, around
        self.losses: list[float] = []
        self.untimed_s: list[float] = []  # check and warm-up steps (the compiles happen in them)
        self.held = 0
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.ok = True

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with self.around():
            return self._step(x, y)


def _real_deepspeed() -> Optional[Any]:
    try:
        import deepspeed  # the real one, when installed beside deepspeed_c's compat alias
    except ImportError:
        return None
    return deepspeed if deepspeed.__file__ and "deepspeed_c" not in deepspeed.__file__ else None


def build(name: str, make_model: Callable[[], torch.nn.Module], args: Any, dev: torch.device) -> Optional[Engine]:
    import torch.nn.functional as F

    if name in ("dsc-eager", "dsc-dc", "dsc-dc-nb", "ds-eager", "ds-dc"):
        lib = _real_deepspeed() if name.startswith("ds-") else __import__("deepspeed_c")
        if lib is None:
            return None
        torch_linear = F.linear
        model = make_model()
        dc = name.endswith("-dc") or name == "dsc-dc-nb"
        engine, *_ = lib.initialize(model=model, config=ds_config(args.micro, dc),
                                    model_parameters=model.parameters())
        # DeepSpeed's eager ZeRO-3 swaps F.linear process-wide for its own; keep it to DeepSpeed's steps
        own_linear = F.linear
        F.linear = torch_linear
        if dc:
            engine.compile(backend="inductor")
        from deepspeed_c.compile.passes import zero3_compile

        @contextlib.contextmanager
        def around() -> Any:
            F.linear = own_linear
            zero3_compile.ACROSS_BOUNDARY = name != "dsc-dc-nb"
            try:
                yield
            finally:
                F.linear = torch_linear
                zero3_compile.ACROSS_BOUNDARY = True

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return Engine(name, step, around)
    if name in ("fsdp2", "fsdp2-tc"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = make_model().to(dev)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        run = torch.compile(model) if name == "fsdp2-tc" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=dev.type == "cuda")

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = run(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        return Engine(name, step)
    raise ValueError(f"unknown engine {name!r} (argument --engines; known: {', '.join(ALL)})")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _allocated(dev: torch.device) -> int:
    return torch.cuda.memory_allocated() if dev.type == "cuda" else 0


def run(rank: int, world: int, args: Any) -> None:
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    from model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)

    torch.manual_seed(0)
    base = GPT(cfg)  # built once (a 1.3B init on the host takes seconds); every engine starts from a copy

    def make_model() -> torch.nn.Module:
        return copy.deepcopy(base)

    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1234)
    total_steps = args.check + args.warmup + args.blocks * args.steps
    batches = [torch.randint(0, args.vocab, (args.micro * world, args.seq + 1), generator=g) for _ in range(8)]

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = batches[i % len(batches)][rank * args.micro:(rank + 1) * args.micro].to(dev)
        return b[:, :-1].contiguous(), b[:, 1:].contiguous()

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{'GPU ' + torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'} x{world}  torch {torch.__version__}"
        f"  GPT {nparams / 1e6:.1f}M (d {args.n_embd}, {args.n_layer} layers, seq {args.seq}, micro {args.micro}), "
        f"bf16, ZeRO-3, AdamW, clipping 1.0; {total_steps} steps per engine", flush=True)
    engines: list[Engine] = []
    for name in args.engines.split(","):
        before = _allocated(dev)
        e = build(name.strip(), make_model, args, dev)
        if e is None:
            say(f"!! {name}: the real DeepSpeed is not importable; left out", flush=True)
            continue
        e.held = _allocated(dev) - before
        engines.append(e)
        say(f"   {name}: built ({e.held / 2**30:.2f} GiB held)", flush=True)
    del base
    # correctness first: the first steps (our compiled engines compile in the first one; DeepSpeed's
    # DeepCompile runs DS_WARMUP eager steps, then compiles again with its prefetch/selective-gather passes,
    # so it gets that many more untimed steps)
    for e in engines:
        warm = args.warmup + (DS_WARMUP + 2 if e.name == "ds-dc" else 0)
        for i in range(args.check + warm):
            _sync(dev)
            t = time.perf_counter()
            loss = e.step(*batch(i))
            _sync(dev)
            e.untimed_s.append(time.perf_counter() - t)
            if i < args.check:
                e.losses.append(loss)
        say(f"   {e.name}: {len(e.untimed_s)} untimed steps in {sum(e.untimed_s):.1f} s", flush=True)
    anchor = engines[0].losses
    for e in engines[1:]:
        rel = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(anchor, e.losses))
        e.ok = rel <= 2e-2
        say(f"   {e.name:10s} losses {['%.4f' % v for v in e.losses]}  max rel diff vs {engines[0].name} "
            f"{rel:.2e}{'' if e.ok else '  DISAGREES: not timed'}", flush=True)
    say(f"   {engines[0].name:10s} losses {['%.4f' % v for v in anchor]}", flush=True)
    timed = [e for e in engines if e.ok]
    for blk in range(args.blocks):
        for e in timed:
            _sync(dev)
            start = _allocated(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for s in range(args.steps):
                e.step(*batch(args.check + blk * args.steps + s))
            _sync(dev)
            dist.barrier()
            e.times.append((time.perf_counter() - t) / args.steps)
            if dev.type == "cuda":
                e.peaks.append(torch.cuda.max_memory_allocated() - start)
    base = statistics.median(timed[0].times) if timed and timed[0].times else float("nan")
    rows = []
    say(f"{'engine':10s} {'ms/step':>9s} {'tok/s':>10s} {'vs ' + timed[0].name:>14s} {'compile s':>10s} "
        f"{'held GiB':>9s} {'peak GiB':>9s}", flush=True)
    for e in timed:
        ms = statistics.median(e.times) * 1e3
        tok = args.micro * args.seq * world / (ms / 1e3)
        comp = max(sum(e.untimed_s) - len(e.untimed_s) * ms / 1e3, 0.0)
        peak = max(e.peaks) / 2**30 if e.peaks else float("nan")
        row = {"engine": e.name, "ms_per_step": ms, "tokens_per_s": tok, "ratio_vs_anchor": base * 1e3 / ms,
               "compile_s": comp, "held_gib": e.held / 2**30, "peak_above_held_gib": peak, "losses": e.losses}
        rows.append(row)
        say(f"{e.name:10s} {ms:9.1f} {tok:10.0f} {row['ratio_vs_anchor']:13.3f}x {comp:10.1f} "
            f"{row['held_gib']:9.2f} {peak:9.2f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "params": nparams, "args": vars(args), "engines": rows,
                       "disagreeing": [e.name for e in engines if not e.ok]}, f, indent=1)


def _rank_main(rank: int, world: int, port: int, args: Any) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n_embd", type=int, default=2048)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--engines", default=",".join(ALL))
    ap.add_argument("--check", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps after the check steps (every engine)")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 gloo ranks, a tiny GPT")
    args = ap.parse_args()
    if args.tiny:
        import socket

        import torch.multiprocessing as mp

        args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq, args.micro = 32, 2, 2, 64, 16, 2
        args.check, args.blocks, args.steps = 2, 2, 2
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank_main, args=(2, port, args), nprocs=2, join=True)
        return
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        run(dist.get_rank(), dist.get_world_size(), args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
