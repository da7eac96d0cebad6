"""graph_harvesting on one GPU: the stage-0 bf16 step (l2norm + fused Adam epilogue) replayed from a CUDA graph
against the same step launched eagerly (runtime/graph_harvesting.py).

Correctness first: two engines built from the same seed (key off / on) train the same batches; losses and final
weights must be equal bit for bit (the graph replays the same kernels on the same tensors), the "on" engine must
have recorded its step and replayed it, and a WarmupLR run (lr moving every step, then constant) must equal its
eager twin too (eager while the lr moves, recorded once it settles).
Then timings, the two engines interleaved rep by rep: the host time of engine.step() with an idle queue
(synchronized before the call, not after: what the CPU spends launching the step) and the whole step's time
(synchronized after). DeepSpeed 0.19.8 removed graph_harvesting (its issue 8489), so there is no competitor for
the recorded step; its 0.19.6 BF16_Optimizer recorded only the gradient norm, clipping and fp32 accumulation.

  python benchmarks/graph_harvesting.py --layers 12 --d 512 --steps 30 --reps 5"""
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
    """Many parameter tensors (per layer: two LayerNorms, four Linears with bias): the host cost of a step grows
    with their count."""

    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d), "proj": torch.nn.Linear(d, d),
                "ln2": torch.nn.LayerNorm(d), "fc": torch.nn.Linear(d, 4 * d), "out": torch.nn.Linear(4 * d, d)}))
        self.head = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b["qkv"](b["ln1"](x))[..., : x.shape[-1]]
            x = x + b["proj"](h)
            x = x + b["out"](torch.nn.functional.gelu(b["fc"](b["ln2"](x))))
        return self.head(x).float().pow(2).mean()


def _engine(args: Any, harvest: bool, warmup: bool) -> Any:
    import deepspeed_c

    torch.manual_seed(0)
    model = Net(args.layers, args.d)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10**9,
                           "gradient_clipping": 1.0, "bf16": {"enabled": True}, "graph_harvesting": harvest,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}}
    if warmup:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-4}}
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _batch(args: Any, step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    return torch.randn(args.batch, args.seq, args.d, generator=g, device="cuda", dtype=torch.bfloat16)


def _step(engine: Any, x: torch.Tensor, overflow: bool = False) -> tuple[float, float, float]:
    """(loss, host seconds of engine.step() from an idle queue, seconds of the whole step incl. the device);
    overflow: the gradients of this step are made non-finite (the step must be skipped)."""
    loss = engine(x)
    engine.backward(loss * float("inf") if overflow else loss)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return float(loss.detach()), t1 - t0, t2 - t0


def _check(args: Any, warmup: bool) -> str:
    off, on = _engine(args, False, warmup), _engine(args, True, warmup)
    bad = {args.check_steps - 3}  # after the recording: the replayed step must skip on the device
    for s in range(args.check_steps):
        x = _batch(args, s)
        a, b = _step(off, x, s in bad)[0], _step(on, x, s in bad)[0]
        if a != b:
            raise AssertionError(f"graph_harvesting changed the loss at step {s} (warmup={warmup}): {a!r} vs {b!r}")
    if (off.skipped_steps, on.skipped_steps) != (1, 1):
        raise AssertionError(f"the overflowing step was not skipped once by both (warmup={warmup}): skipped "
                             f"{off.skipped_steps} eager, {on.skipped_steps} harvested")
    for p, q in zip(off.module.parameters(), on.module.parameters()):
        if not torch.equal(p, q):
            raise AssertionError(f"graph_harvesting changed the weights (warmup={warmup})")
    h = on.optimizer.harvest
    if h is None or h.captures < 1 or h.replays < 1:
        raise AssertionError(f"graph_harvesting did not record and replay the step (warmup={warmup}): "
                             f"{None if h is None else (h.captures, h.replays, h.eager, h.failed)}")
    return (f"{'WarmupLR' if warmup else 'constant lr':12s} {args.check_steps} steps (one overflowing, skipped by "
            f"both): losses and weights equal bit for bit; captures {h.captures}, replays {h.replays}, eager {h.eager}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--check_steps", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per rep and engine")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_harvesting benchmark: needs a CUDA device")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29547"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                       ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    print("== correctness (graph_harvesting on vs off, same seed and batches) ==")
    print(_check(args, warmup=False))
    print(_check(args, warmup=True))
    off, on = _engine(args, False, False), _engine(args, True, False)
    n_params = sum(1 for _ in off.module.parameters())
    for s in range(3):  # warm-up: op builds, allocator, the recording
        _step(off, _batch(args, s))
        _step(on, _batch(args, s))
    host: dict[str, list[float]] = {"off": [], "on": []}
    whole: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(args.reps):
        for name, engine in (("off", off), ("on", on)) if rep % 2 == 0 else (("on", on), ("off", off)):
            h, w = [], []
            for s in range(args.steps):
                _, dh, dw = _step(engine, _batch(args, 100 + s))
                h.append(dh)
                w.append(dw)
            host[name].append(statistics.median(h))
            whole[name].append(statistics.median(w))
    ho, hn = statistics.median(host["off"]) * 1e3, statistics.median(host["on"]) * 1e3
    wo, wn = statistics.median(whole["off"]) * 1e3, statistics.median(whole["on"]) * 1e3
    print(f"== timings ({args.layers} layers d={args.d}, {n_params} parameter tensors, bf16 stage 0, AdamW; median "
          f"of {args.reps} interleaved reps x {args.steps} steps) ==")
    print(f"{'':28s} {'eager':>9s} {'graph':>9s} {'eager/graph':>12s}")
    print(f"{'engine.step() host ms':28s} {ho:9.3f} {hn:9.3f} {ho / hn:11.2f}x")
    print(f"{'engine.step() whole ms':28s} {wo:9.3f} {wn:9.3f} {wo / wn:11.2f}x")
    print("DeepSpeed 0.19.8: no graph_harvesting (removed, issue 8489); nothing to run side by side")


if __name__ == "__main__":
    main()
