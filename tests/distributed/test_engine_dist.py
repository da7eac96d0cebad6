"""The data-parallel reducer on 2 gloo ranks: parameters without gradients on some ranks, frozen
parameters, no_sync, direct loss.backward(), scale(loss).backward(), one collective per bucket,
predivide/prescale, fp16 communication, and re-planning in observed gradient order. Every case
is checked against a single-process reference computed from both ranks' data.

One spawn runs every scenario; each test checks one."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.engine_models import MLP, loss_fn
from tests.harness import run_distributed

WORLD = 2


class Branchy(torch.nn.Module):
    """Rank-dependent control flow: each sample batch picks one head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(12, 8)
        self.head_a = torch.nn.Linear(8, 3)
        self.head_b = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.trunk(x)))
        return self.head_a(h) if use_a else self.head_b(h)


class Shuffled(torch.nn.Module):
    """Modules run in an order unrelated to registration, so backward order differs from the plan's guess."""

    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Linear(8, 3)
        self.a = torch.nn.Linear(12, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def rank_data(rank: int, n: int = 4, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(n, 12, generator=g), torch.randn(n, 3, generator=g)


def _np_grads(module: torch.nn.Module) -> dict[str, Any]:
    return {n: (None if p.grad is None else p.grad.detach().float().numpy().copy())
            for n, p in module.named_parameters()}


def _engine(model: torch.nn.Module, **cfg: Any):
    import deepspeed_c

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 40}}
    config.update(cfg)
    engine, *_ = deepspeed_c.initialize(model=model, config=config)
    return engine


def scenario_unused_and_frozen(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = _engine(Branchy())
    x, y = rank_data(rank)
    engine.backward(loss_fn(engine(x, use_a=(rank == 0)), y))
    return _np_grads(engine.module)


def scenario_no_sync(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = _engine(MLP(), gradient_accumulation_steps=1)
    x, y = rank_data(rank)
    with engine.no_sync():
        engine.backward(loss_fn(engine(x), y))
    local = _np_grads(engine.module)
    collectives_after_no_sync = engine.reducer.collectives
    x2, y2 = rank_data(rank, seed=50)
    engine.backward(loss_fn(engine(x2), y2))
    return {"local": local, "reduced": _np_grads(engine.module), "no_sync_collectives": collectives_after_no_sync}


def scenario_direct_and_scale(rank: int) -> dict[str, Any]:
    out = {}
    for mode in ("engine", "direct", "scale"):
        torch.manual_seed(0)
        engine = _engine(MLP(), gradient_accumulation_steps=2)
        for micro in range(2):
            x, y = rank_data(rank, seed=10 * micro)
            loss = loss_fn(engine(x), y)
            if mode == "engine":
                engine.backward(loss)
            elif mode == "direct":
                loss.backward()
            else:
                engine.scale(loss).backward()
            if micro == 0:
                out[f"{mode}_collectives_first_micro"] = engine.reducer.collectives
                engine.step()  # a non-boundary step: only advances the micro-step counter
        out[mode] = _np_grads(engine.module)
        out[f"{mode}_collectives"] = engine.reducer.collectives
        out[f"{mode}_buckets"] = engine.reducer.num_buckets
    return out


def scenario_scaling_options(rank: int) -> dict[str, Any]:
    out = {}
    for name, cfg in (("predivide", {"gradient_predivide_factor": 2.0}), ("prescale", {"prescale_gradients": True}),
                      ("comm_fp16", {"communication_data_type": "fp16"})):
        torch.manual_seed(0)
        engine = _engine(MLP(), **cfg)
        x, y = rank_data(rank)
        engine.backward(loss_fn(engine(x), y))
        out[name] = _np_grads(engine.module)
        out[name + "_dtype"] = str(engine.reducer.buffers[0].dtype)
    return out


def scenario_observed_order(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = _engine(Shuffled())
    initial = list(engine.reducer._order)
    for step in range(3):
        x, y = rank_data(rank, seed=100 + step)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return {"initial": initial, "final": list(engine.reducer._order),
            "weights": {n: p.detach().numpy().copy() for n, p in engine.module.named_parameters()}}


def scenario_overlap(rank: int) -> dict[str, Any]:
    """How many buckets were already on the wire when backward reached the first layer's weight."""
    torch.manual_seed(0)
    engine = _engine(MLP())
    seen: list[int] = []
    first = next(engine.module.parameters())
    first.register_post_accumulate_grad_hook(lambda p: seen.append(engine.reducer._launched))
    x, y = rank_data(rank)
    engine.backward(loss_fn(engine(x), y))
    return {"launched_during_backward": seen, "buckets": engine.reducer.num_buckets,
            "bucket_of_first": engine.reducer.plan.layout.bucket_of[0]}


def scenario_fp16_overflow_on_one_rank(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = _engine(MLP(), fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    x, y = rank_data(rank)
    engine.backward(loss_fn(engine(x.half()), y.half()))
    before = [p.detach().clone() for p in engine.module.parameters()]
    if rank == 0:
        next(engine.module.parameters()).grad[0, 0] = float("inf")
    engine.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    engine.backward(loss_fn(engine(x.half()), y.half()))
    engine.step()
    return {"applied": engine.was_step_applied(), "unchanged_after_overflow": unchanged,
            "scale": engine.optimizer.cur_scale, "skipped": engine.skipped_steps,
            "weights": {n: p.detach().float().numpy().copy() for n, p in engine.module.named_parameters()}}


SCENARIOS = {f.__name__: f for f in (scenario_unused_and_frozen, scenario_no_sync, scenario_direct_and_scale,
                                     scenario_scaling_options, scenario_observed_order, scenario_overlap,
                                     scenario_fp16_overflow_on_one_rank)}


def body(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        try:
            out[name] = fn(rank)
        except Exception as e:
            import traceback

            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    return out


_CACHE: list[Any] = []


def results(name: str) -> list[dict[str, Any]]:
    if not _CACHE:
        # a CPU test of the reducer by design: gloo and host tensors, also on a machine with GPUs
        _CACHE.append(run_distributed(body, world_size=WORLD, timeout=300, backend="gloo",
                                      env={"DS_ACCELERATOR": "cpu"}))
    per_rank = [r[name] for r in _CACHE[0]]
    for r in per_rank:
        assert "error" not in r, r.get("error")
    return per_rank


def reference_grads(model: torch.nn.Module, run) -> dict[str, Any]:
    """Gradients of the mean over ranks of each rank's loss, in one process."""
    total = sum(run(model, rank) for rank in range(WORLD)) / WORLD
    total.backward()
    return {n: (None if p.grad is None else p.grad.detach().numpy()) for n, p in model.named_parameters()}


def assert_close(got: dict[str, Any], ref: dict[str, Any], rtol: float = 1e-6, atol: float = 1e-7) -> None:
    for name, value in ref.items():
        if value is None:
            assert got[name] is None, name
            continue
        assert torch.allclose(torch.from_numpy(got[name]), torch.from_numpy(value), rtol=rtol, atol=atol), name


def test_unused_params_get_averaged_zero_and_frozen_stay_gradless():
    per_rank = results("scenario_unused_and_frozen")
    torch.manual_seed(0)
    ref = reference_grads(Branchy(), lambda m, r: loss_fn(m(rank_data(r)[0], use_a=(r == 0)), rank_data(r)[1]))
    ref["head_b.weight"] = ref["head_b.weight"]  # rank 1's head: rank 0 contributes zeros
    for got in per_rank:
        assert got["frozen.weight"] is None and got["frozen.bias"] is None
        assert_close(got, {k: v for k, v in ref.items() if not k.startswith("frozen")})
    assert (per_rank[0]["head_a.weight"] == per_rank[1]["head_a.weight"]).all()


def test_no_sync_keeps_gradients_local_then_reduces_the_sum():
    per_rank = results("scenario_no_sync")
    torch.manual_seed(0)
    base = MLP()
    for rank, got in enumerate(per_rank):
        model = MLP()
        model.load_state_dict(base.state_dict())
        x, y = rank_data(rank)
        loss_fn(model(x), y).backward()
        assert_close(got["local"], {n: p.grad.numpy() for n, p in model.named_parameters()})
        assert got["no_sync_collectives"] == 0

    def both(m: torch.nn.Module, r: int) -> torch.Tensor:
        x, y = rank_data(r)
        x2, y2 = rank_data(r, seed=50)
        return loss_fn(m(x), y) + loss_fn(m(x2), y2)

    model = MLP()
    model.load_state_dict(base.state_dict())
    ref = reference_grads(model, both)
    for got in per_rank:
        assert_close(got["reduced"], ref)


def test_direct_backward_and_scale_match_engine_backward():
    per_rank = results("scenario_direct_and_scale")
    torch.manual_seed(0)
    model = MLP()

    def gas2(m: torch.nn.Module, r: int) -> torch.Tensor:
        return sum(loss_fn(m(rank_data(r, seed=10 * k)[0]), rank_data(r, seed=10 * k)[1]) for k in range(2)) / 2

    ref = reference_grads(model, gas2)
    for got in per_rank:
        assert_close(got["engine"], ref)
        for mode in ("direct", "scale"):
            for name, value in got["engine"].items():
                assert (got[mode][name] == value).all(), f"{mode}: {name}"
            # the non-boundary micro-step communicates nothing; the boundary one one all-reduce per bucket
            assert got[f"{mode}_collectives_first_micro"] == 0
            assert got[f"{mode}_collectives"] == got[f"{mode}_buckets"] > 1


def test_predivide_prescale_and_fp16_communication():
    per_rank = results("scenario_scaling_options")
    torch.manual_seed(0)
    ref = reference_grads(MLP(), lambda m, r: loss_fn(m(rank_data(r)[0]), rank_data(r)[1]))
    for got in per_rank:
        assert_close(got["predivide"], ref)
        assert_close(got["prescale"], ref)
        assert got["comm_fp16_dtype"] == "torch.float16"
        assert_close(got["comm_fp16"], ref, rtol=2e-3, atol=1e-4)


def test_replans_in_observed_order_and_stays_correct():
    per_rank = results("scenario_observed_order")
    assert per_rank[0]["final"] == per_rank[1]["final"]
    assert per_rank[0]["final"] != per_rank[0]["initial"]
    torch.manual_seed(0)
    model = Shuffled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        reference_grads(model, lambda m, r: loss_fn(m(rank_data(r, seed=100 + step)[0]),
                                                    rank_data(r, seed=100 + step)[1]))
        opt.step()
        opt.zero_grad()
    for got in per_rank:
        for name, p in model.named_parameters():
            assert torch.allclose(torch.from_numpy(got["weights"][name]), p.detach(), rtol=1e-5, atol=1e-7), name


def test_buckets_go_out_while_backward_runs():
    for got in results("scenario_overlap"):
        # the first layer's weight arrives last: every bucket before its own is already launched
        assert got["buckets"] > 2 and got["bucket_of_first"] == got["buckets"] - 1
        assert got["launched_during_backward"][0] >= got["buckets"] - 1


def test_fp16_overflow_on_one_rank_skips_on_every_rank():
    per_rank = results("scenario_fp16_overflow_on_one_rank")
    for got in per_rank:
        assert got["unchanged_after_overflow"] and got["skipped"] == 1 and got["applied"]
        assert got["scale"] == 128  # 256 halved once (hysteresis 1)
    for name, value in per_rank[0]["weights"].items():
        assert (value == per_rank[1]["weights"][name]).all(), name


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    torch.set_num_threads(1)
