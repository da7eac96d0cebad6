"""ZeRO-3 memory held by the gradient reduction and the step (issue 48), on 2 gloo ranks in one launch.

- Sent reduce-scatter buckets: at most DSC_ZERO_REDUCE_WINDOW (default 1) are unfinished at any launch, where
  before every bucket of the backward stayed alive to its end (a whole unsharded gradient per rank); with the
  window at 0 (the old behaviour) they pile up to every bucket of the backward, which shows the count is live.
- The step gathers the next forward's first units once their chunks are written (DSC_Z3_PREFETCH_IN_STEP):
  they are gathered between the step and the forward, and none are with the switch off.
- The new run (buckets sent in backward order too) and the old one (window 0, plan order, no gathers in the
  step) train the same: identical losses and fp32 master partitions, bit for bit (what is added and gathered
  does not change, only when), and those match plain PyTorch on the whole batch.
- ShardSlots (where the fused CUDA step writes the updated 16-bit chunk) hands out exactly the span of the
  shard the shard writer fills for that bucket, so a chunk written there is the shard's value, and the writer
  then skips the copy; a chunk from elsewhere is copied in."""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from tests.harness import run_distributed

WIDTH, DEPTH, MICRO, STEPS, WORLD = 12, 6, 4, 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(MICRO * WORLD, WIDTH, generator=gen), torch.randn(MICRO * WORLD, WIDTH, generator=gen))
            for _ in range(STEPS)]


def _config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


OLD_ENV = {"DSC_ZERO_REDUCE_WINDOW": "0", "DSC_Z3_REDUCE_ORDER": "plan", "DSC_Z3_PREFETCH_IN_STEP": "0"}


def _train(rank: int, old: bool) -> tuple[tuple[list[float], np.ndarray, int, int, list[int]], Any]:
    import deepspeed_c

    for key, value in OLD_ENV.items():
        if old:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
    engine, *_ = deepspeed_c.initialize(model=_model(), config=_config())
    reducer = engine.optimizer.reducer
    launch = reducer._launch
    seen = {"max": 0, "launches": 0}

    def counted(slot: int, late: Any = None) -> None:
        launch(slot, late)
        seen["launches"] += 1
        seen["max"] = max(seen["max"], len(reducer._in_flight))

    reducer._launch = counted
    losses, early = [], []
    store = engine.optimizer.store
    for x, y in _batches():
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = torch.nn.functional.mse_loss(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        early.append(sum(f is not None for f in store.full))  # gathered between the step and the next forward
    master = engine.optimizer.fp32_partitions[0].detach().clone().numpy()
    return (losses, master, seen["max"], seen["launches"] // STEPS, early), engine


def _shard_slots(rank: int, engine: Any) -> bool:
    from deepspeed_c.runtime.zero.stage3 import ShardSlots, ShardWriter

    opt = engine.optimizer
    store = opt.store
    writer, slots = ShardWriter(store), ShardSlots(store)
    assert ShardSlots.usable(store, opt.fp32_partitions[0], store.dtype)
    assert not ShardSlots.usable(store, opt.fp32_partitions[0], torch.bfloat16)  # the step's dtype differs
    for b in range(store.plans[0].num_buckets):
        slot = slots.own_slot(0, b, rank, WORLD)
        start = store.plans[0].bucket_offset[b] // WORLD
        assert slot.data_ptr() == store.shards[0][start:].data_ptr() and slot.numel() == store.plans[0].bucket_size[b] // WORLD
        slot.fill_(float(b + 1))  # the step writes here: the writer's copy is skipped, the shard holds it
        writer.submit(0, b, slot)
        assert torch.equal(store.shards[0][start:start + slot.numel()], torch.full_like(slot, float(b + 1)))
        other = torch.full_like(slot, -float(b + 1))  # a chunk from a scratch: copied in
        writer.submit(0, b, other)
        assert torch.equal(store.shards[0][start:start + slot.numel()], other)
    engine.destroy()
    return True


def _body(rank: int, world_size: int) -> dict[str, Any]:
    new, engine = _train(rank, False)
    engine.destroy()
    old, engine = _train(rank, True)
    return {"new": new, "old": old, "slots": _shard_slots(rank, engine)}


def _reference() -> list[float]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for x, y in _batches():
        loss = torch.nn.functional.mse_loss(model(x), y)  # the mean over both ranks' halves
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_reduce_window_prefetch_in_step_and_send_order_train_the_same() -> None:
    results = run_distributed(_body, world_size=WORLD, timeout=240)
    ref = _reference()
    for res in results:
        new_losses, new_master, new_max, launches, new_early = res["new"]
        old_losses, old_master, old_max, _, old_early = res["old"]
        assert launches >= 4, f"{launches} buckets a backward: the window is not exercised"
        assert new_max <= 1, f"{new_max} sent buckets unfinished at once with the window at 1"
        assert old_max == launches, f"window 0 kept {old_max} of {launches} buckets (expected all)"
        # the step gathered the next forward's first unit(s) (the fetch plan's first step) after writing them
        assert all(n >= 1 for n in new_early) and not any(old_early), (new_early, old_early)
        assert new_losses == old_losses
        assert np.array_equal(new_master, old_master)
        assert res["slots"]
    # the ranks' mean loss is the whole batch's: plain PyTorch on one process
    for k in range(STEPS):
        mean = sum(r["new"][0][k] for r in results) / WORLD
        assert abs(mean - ref[k]) <= 1e-5 * max(1.0, abs(ref[k])), (k, mean, ref[k])
