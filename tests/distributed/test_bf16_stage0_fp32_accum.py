"""bf16 at ZeRO stage 0 with data_types.grad_accum_dtype "fp32" (DeepSpeed's BF16_Optimizer) on 2
and 4 gloo ranks.

DeepSpeed 0.19.8: every micro-step's bf16 gradient is folded into an fp32 accumulator; on the
accumulation boundary the engine all-reduces those fp32 accumulators, cast to
communication_data_type (bf16 by default) on the wire and averaged, and copies the result back into
the fp32 accumulators, which the optimizer steps on. Reference, computed here from the same bf16
model on every rank's micro-batches: the same fold in fp32, the cast, the sum over ranks in rank
order (bf16 rounding after each addition) and the average; then SGD on the fp32 masters. The
reference and the engine do the same arithmetic, so the tolerance is 1e-5 norm-wise relative on the
master update (read back from the fp32 masters, whose rounding alone is ~3e-6); accumulating in bf16 instead (the default path) differs by more than 1e-3 here,
which the test also checks, so it sees the accumulation dtype. Memory: between micro-steps a rank
holds exactly 4 bytes of fp32 gradient per parameter (the accumulators; no 16-bit param.grad)."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.engine_models import MLP
from tests.harness import run_distributed

GAS, LR, MICRO = 4, 0.1, 2


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(MICRO * world, 12, generator=g).bfloat16(), torch.randn(MICRO * world, 3, generator=g))
            for _ in range(2 * GAS)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP().bfloat16()


def body(rank: int, world: int, accum: str, wire: str) -> dict[str, Any]:
    import deepspeed_c

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "SGD", "params": {"lr": LR}}, "bf16": {"enabled": True},
           "data_types": {"grad_accum_dtype": accum}}
    if wire != "default":
        cfg["communication_data_type"] = wire
    engine, *_ = deepspeed_c.initialize(model=_model(), config=cfg)
    opt = engine.optimizer
    masters = [m for g in opt.fp32_groups for m in g]
    n = sum(m.numel() for m in masters)
    start = [m.detach().double().clone() for m in masters]
    held, updates = [], []
    for k, (x, y) in enumerate(_batches(world)):
        xs, ys = x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]
        engine.backward(torch.nn.functional.mse_loss(engine(xs).float(), ys))
        fp32 = [t for t in list(opt._grad_buffers) + [p.grad for p in engine.module.parameters()]
                if t is not None and t.dtype == torch.float32]
        held.append(sum(t.numel() * t.element_size() for t in fp32) - 4 * n)
        engine.step()
        if k == GAS - 1:
            updates.append([((s - m.detach().double()) / LR) for s, m in zip(start, masters)])
    engine.destroy()
    return {"update": [u.numpy() for u in updates[0]], "held_extra": held}


@functools.lru_cache(maxsize=None)
def _run(world: int, accum: str, wire: str) -> list[dict[str, Any]]:
    return run_distributed(body, world, args=(accum, wire), timeout=180)


def reference_update(world: int, fp32_accumulation: bool, wire_dtype: torch.dtype) -> list[torch.Tensor]:
    model = _model()
    params = list(model.parameters())
    per_rank = []
    batches = _batches(world)[:GAS]
    for r in range(world):
        acc = [torch.zeros_like(p, dtype=torch.float32 if fp32_accumulation else torch.bfloat16) for p in params]
        for x, y in batches:
            model.zero_grad(set_to_none=True)
            xs, ys = x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO]
            (torch.nn.functional.mse_loss(model(xs).float(), ys) / GAS).backward()
            for a, p in zip(acc, params):
                a.add_(p.grad.to(a.dtype))
        per_rank.append(acc)
    out = []
    for i in range(len(params)):
        wire = per_rank[0][i].to(wire_dtype)
        for r in range(1, world):
            wire = wire + per_rank[r][i].to(wire_dtype)
        out.append((wire * (1.0 / world)).float().double())
    return out


# 2 ranks: the default bf16 wire (one bf16 addition, so the order of the sum cannot matter);
# 4 ranks: communication_data_type fp32 (gloo's summation order then moves results by ~1e-7 only)
@pytest.mark.parametrize("world,wire", [(2, "default"), (4, "fp32")])
def test_fp32_accumulation_reduces_the_fp32_sums(world: int, wire: str) -> None:
    wire_dtype = torch.bfloat16 if wire == "default" else torch.float32
    want = reference_update(world, True, wire_dtype)
    other = reference_update(world, False, wire_dtype)
    apart = torch.cat([o.reshape(-1) for o in other]) - torch.cat([w.reshape(-1) for w in want])
    assert float(apart.norm() / torch.cat([w.reshape(-1) for w in want]).norm()) > 1e-3
    for res in _run(world, "fp32", wire):
        for got, ref in zip(res["update"], want):
            got = torch.from_numpy(got)
            rel = float((got - ref).norm() / ref.norm())
            assert rel < 1e-5, rel
        assert res["held_extra"] == [0] * (2 * GAS), res["held_extra"]
