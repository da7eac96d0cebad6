"""The `zeropp` section of benchmarks/compressed_comm.py: ZeRO++ against plain ZeRO-3 on the same ranks
(gloo on CPU; NCCL one GPU a rank with DSC_TEST_BACKEND=nccl), same model, data and seed.

Per variant (plain ZeRO-3; qwZ; qgZ; qwZ + qgZ + hpZ with H = world / 2 when world >= 4): the bytes
each rank hands to collectives in one steady step, by op (the comms logger's counts), and the median
ms per step over interleaved reps (variant after variant, rep after rep). Correctness first: the
quantized variants' losses within 2% of ZeRO-3's first loss at every step.

hpZ does not change the bytes a rank hands over; it moves the gathers that follow a release (until the
next step) into the group of H ranks, a node's, off the inter-node links. With torch's nn.Linear there
are none in the backward: autograd keeps the transposed weight view it saved in the forward, so the
gathered buffer lives until the backward and is not gathered again.

    python benchmarks/compressed_comm.py --sections zeropp [--world 2] [--steps 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

WIDTH, LAYERS, MICRO = 1024, 8, 8


def _variants(world: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"zero3": {}, "qwZ": {"zero_quantized_weights": True},
                                      "qgZ": {"zero_quantized_gradients": True}}
    if world >= 4:
        out["qwZ+qgZ+hpZ"] = {"zero_quantized_weights": True, "zero_quantized_gradients": True,
                              "zero_hpz_partition_size": world // 2}
    return out


def _body(rank: int, world: int, steps: int) -> dict[str, Any]:
    import torch

    import deepspeed_c
    import deepspeed_c.comm as dc
    from tests.harness import rank_device

    dev = rank_device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    engines, losses = {}, {}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO, WIDTH, generator=g).to(dev, dtype)
    for name, zpp in _variants(world).items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "gradient_clipping": 0.0,
               "zero_allow_untested_optimizer": True,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zpp}}
        if dtype == torch.bfloat16:
            cfg["bf16"] = {"enabled": True}
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        engine, _, _, _ = deepspeed_c.initialize(model=model, optimizer=opt, config=cfg)
        engines[name] = engine
        losses[name] = []

    def step(name: str) -> float:
        engine = engines[name]
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    for name in engines:  # two steps each: the fetch plan is recorded, then followed
        losses[name] += [step(name), step(name)]
    nbytes: dict[str, dict[str, int]] = {}
    for name in engines:
        dc.configure(enabled=True, prof_all=True)
        dc.comms_logger.reset_data()
        step(name)
        raw = dc.comms_logger.get_raw_data()
        dc.configure(enabled=False)
        nbytes[name] = {op: sum(size * rec[0] for size, rec in by_size.items()) for op, by_size in raw.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name in engines:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            step(name)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) * 1e3)
    return {"losses": losses, "bytes": nbytes, "ms": {k: statistics.median(v) for k, v in times.items()}}


def run(args: argparse.Namespace) -> None:
    from tests.harness import backend_choice, run_distributed

    world = int(args.world)
    res = run_distributed(_body, world, args=(int(args.steps),), timeout=1800)[0]
    base = res["losses"]["zero3"]
    for name, ls in res["losses"].items():  # correctness first
        if any(abs(a - b) > 0.02 * abs(base[0]) for a, b in zip(ls, base)):
            raise SystemExit(f"{name}: losses {ls} not within 2% of ZeRO-3's first loss ({base})")
    print(f"ZeRO++ vs ZeRO-3, {world} ranks ({backend_choice()}), {LAYERS} x Linear({WIDTH}, {WIDTH}), "
          f"micro-batch {MICRO}; bytes handed to collectives per rank in one steady step")
    ops = sorted({op for b in res["bytes"].values() for op in b})
    head = f"{'variant':<14}" + "".join(f"{op[:22]:>24}" for op in ops)
    head += f"{'total':>14}{'ratio':>8}{'ms/step':>10}{'x':>7}"
    print(head)
    tot0 = sum(res["bytes"]["zero3"].values())
    ms0 = res["ms"]["zero3"]
    for name, b in res["bytes"].items():
        tot = sum(b.values())
        row = f"{name:<14}" + "".join(f"{b.get(op, 0):>24,}" for op in ops)
        print(row + f"{tot:>14,}{tot / tot0:>8.3f}{res['ms'][name]:>10.2f}{ms0 / res['ms'][name]:>7.2f}")
    if os.environ.get("DSC_TEST_BACKEND", "gloo") == "gloo":
        print("(gloo on a shared CPU host: the bytes are the result; step times say little about a network)")
