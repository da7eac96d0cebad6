"""ZeRO-1/2 on gloo: which collectives a step issues and how big they are, and how much master-weight
and optimizer-state memory each rank holds compared with stage 0.

Communication: every call into deepspeed_c.comm is recorded. An accumulation boundary issues one
reduce_scatter_tensor per gradient bucket (input = the bucket, output = 1/W of it), one
all_gather_into_tensor per bucket for the updated weights, and one all_reduce (the global gradient
norm over the partitions); micro-steps inside an accumulation window issue nothing. The buckets cover
the trainable parameters exactly once plus alignment padding (< 2W elements a bucket).

Memory: master + optimizer state bytes per rank x W equal stage 0's, up to that padding."""
from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.distributed.engine_models import loss_fn, make_batches, make_model
from tests.harness import run_distributed

MICRO = 2
GAS = 2
CAP = 300
RECORDED = ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce", "broadcast", "all_gather",
            "reduce_scatter", "all_reduce_coalesced")


def _numel(t: Any) -> int:
    return int(t.numel()) if isinstance(t, torch.Tensor) else sum(int(x.numel()) for x in t)


def comm_body(rank: int, world: int, stage: int) -> dict[str, Any]:
    import deepspeed_c
    import deepspeed_c.comm as dist

    model = make_model("transformer", seed=3)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 10**9,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0,
              # a small all-gather cap: at most one bucket's gather in flight
              "zero_optimization": {"stage": stage, "reduce_bucket_size": CAP, "allgather_bucket_size": CAP}}
    engine, _, _, _ = deepspeed_c.initialize(model=model, config=config)
    log: list[tuple[str, int, int]] = []
    originals = {name: getattr(dist, name) for name in RECORDED}

    def recorder(name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            if name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
                out, inp = args[0], args[1]
                log.append((name, _numel(inp), _numel(out)))
            else:
                log.append((name, _numel(args[0]) if args and not isinstance(args[0], int) else 0, 0))
            return originals[name](*args, **kwargs)

        return call

    for name in RECORDED:
        setattr(dist, name, recorder(name))
    per_micro: list[list[tuple[str, int, int]]] = []
    grads_after_boundary_backward: list[bool] = []
    try:
        batches = make_batches("transformer", 2 * GAS, MICRO * world, seed=5)
        for k, (x, y) in enumerate(batches):
            del log[:]
            lo, hi = rank * MICRO, (rank + 1) * MICRO
            xs, ys = x[lo:hi].to(engine.device), y[lo:hi].to(engine.device)
            engine.backward(loss_fn(engine(xs), ys))
            if engine.is_gradient_accumulation_boundary():
                grads_after_boundary_backward.append(any(p.grad is not None for p in model.parameters()))
            engine.step()
            per_micro.append(list(log))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine.destroy()
    return {"per_micro": per_micro, "trainable": trainable, "grads_kept": grads_after_boundary_backward}


def memory_body(rank: int, world: int) -> dict[str, Any]:
    import deepspeed_c

    out = {}
    for stage in (0, 1, 2):
        model = make_model("transformer", seed=3)
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": CAP}}
        engine, optimizer, _, _ = deepspeed_c.initialize(model=model, config=config)
        x, y = make_batches("transformer", 1, MICRO * world, seed=5)[0]
        engine.backward(loss_fn(engine(x[:MICRO].to(engine.device)), y[:MICRO].to(engine.device)))
        engine.step()
        inner = getattr(optimizer, "optimizer", optimizer)
        masters = [p for g in inner.param_groups for p in g["params"]]
        state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        buckets = sum(plan.num_buckets for plan in getattr(optimizer, "partition_plans", []))
        out[stage] = {"master": sum(m.numel() * m.element_size() for m in masters),
                      "state": sum(t.numel() * t.element_size() for t in state), "buckets": buckets}
        engine.destroy()
    return out


@functools.lru_cache(maxsize=None)
def _comm_results(world: int, stage: int) -> list[dict[str, Any]]:
    return run_distributed(comm_body, world, args=(stage,), timeout=300)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_collectives_per_step(world: int, stage: int) -> None:
    per_rank = _comm_results(world, stage)
    for res in per_rank:
        assert res["per_micro"] == per_rank[0]["per_micro"]  # every rank issues the same sequence
        for k, calls in enumerate(res["per_micro"]):
            if (k + 1) % GAS != 0:
                assert calls == [], f"micro-step {k} inside the accumulation window communicated: {calls}"
                continue
            rs = [c for c in calls if c[0] == "reduce_scatter_tensor"]
            ag = [c for c in calls if c[0] == "all_gather_into_tensor"]
            ar = [c for c in calls if c[0] == "all_reduce"]
            assert len(rs) + len(ag) + len(ar) == len(calls), calls
            assert len(rs) >= 2, "the small bucket cap must give several buckets"
            assert len(ar) == 1 and ar[0][1] == 1  # one scalar: the squared norm over all partitions
            assert [c[2] for c in ag] == [c[1] for c in rs]  # one all-gather per bucket, same size
            for name, inp, out in rs + ag:
                small, big = (out, inp) if name == "reduce_scatter_tensor" else (inp, out)
                assert big == small * world
                assert big % (2 * world) == 0
            total = sum(c[1] for c in rs)
            assert res["trainable"] <= total < res["trainable"] + len(rs) * 2 * world
        # stage 2 frees the full gradients as their buckets go out; stage 1 keeps them until the step
        assert all(kept == (stage == 1) for kept in res["grads_kept"])


@pytest.mark.parametrize("world", [2, 4])
def test_memory_is_one_over_world(world: int) -> None:
    per_rank = run_distributed(memory_body, world, timeout=300)
    for res in per_rank:
        # stage 0: two fp32 Adam moments per trainable element, plus its fp32 master (the param itself;
        # frozen params count neither as master nor as state under ZeRO)
        full = res[0]["state"] * 3 // 2
        for stage in (1, 2):
            mine = res[stage]["master"] + res[stage]["state"]
            # fp32 master + two fp32 moments = 12 bytes per element, padding < 2W elements a bucket
            padding = res[stage]["buckets"] * 2 * world * 12
            assert full / world <= mine <= (full + padding) / world, (stage, mine, full)
