"""DeepSpeedEngine in one process: initialize's rules, backward/scale/step semantics, gradient
accumulation controls, fp16 loss scaling with an injected overflow, bf16 training, accessors."""
from __future__ import annotations

import argparse
import io
import logging

import pytest
import torch

import deepspeed_c
from deepspeed_c.runtime.engine import DeepSpeedEngine
from deepspeed_c.utils.logging import logger
from tests.distributed.engine_models import MLP, loss_fn


pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


def sgd_config(**kw):
    # clipping off: the references below are plain SGD (DeepSpeed >= 0.19.3 clips at 1.0 by default)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cfg.update(kw)
    return cfg


def make(config, seed=0, model=None, **kw):
    torch.manual_seed(seed)
    model = model or MLP()
    return deepspeed_c.initialize(model=model, config=config, **kw)


def data(n=4, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)


@pytest.fixture
def log_capture():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    yield stream
    logger.removeHandler(handler)


# ---- initialize ---------------------------------------------------------------------------------

def test_initialize_returns_engine_and_nones():
    engine, opt, loader, sched = make(sgd_config())
    assert isinstance(engine, DeepSpeedEngine) and isinstance(engine, torch.nn.Module)
    assert deepspeed_c.DeepSpeedEngine is DeepSpeedEngine
    assert opt is engine.optimizer and isinstance(opt, torch.optim.SGD)
    assert loader is None and sched is None
    engine, opt, _, _ = make({"train_batch_size": 4})  # model only (e.g. evaluation)
    assert opt is None and engine.optimizer is None
    with pytest.raises(AssertionError, match="optimizer"):
        x, y = data()
        engine.backward(loss_fn(engine(x), y))


def test_initialize_rules(tmp_path):
    with pytest.raises(AssertionError, match="requires a model"):
        deepspeed_c.initialize(config=sgd_config())
    with pytest.raises(AssertionError, match="deepspeed_config"):
        deepspeed_c.initialize(model=MLP())
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "gradient_clipping": 0.25}')
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    engine, *_ = deepspeed_c.initialize(args=args, model=MLP())
    assert engine.gradient_clipping() == 0.25
    assert engine.config == {"train_batch_size": 4, "gradient_clipping": 0.25}
    with pytest.raises(AssertionError, match="Not sure how to proceed"):
        deepspeed_c.initialize(args=args, model=MLP(), config={"train_batch_size": 4})
    engine, *_ = deepspeed_c.initialize(model=MLP(), config_params={"train_batch_size": 8})
    assert engine.train_batch_size() == 8


def test_config_dict_is_kept_as_given():
    cfg = sgd_config(zero_optimization={"stage": 0}, steps_per_print=float("inf"))
    engine, *_ = make(cfg)
    assert engine.config is cfg
    assert engine.config.get("zero_optimization", {}).get("stage") == 0


def test_add_config_arguments():
    parser = deepspeed_c.add_config_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(["--deepspeed", "--deepspeed_config", "x.json"])
    assert ns.deepspeed is True and ns.deepspeed_config == "x.json"
    ns = parser.parse_args([])
    assert ns.deepspeed is False and ns.deepspeed_config is None and ns.deepscale_config is None


def test_client_optimizer_and_scheduler_callables():
    made = {}

    def opt_fn(params):
        made["opt"] = torch.optim.SGD(params, lr=0.5)
        return made["opt"]

    def sched_fn(optimizer):
        made["sched_opt"] = optimizer
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    engine, opt, _, sched = make({"train_batch_size": 4}, optimizer=opt_fn, lr_scheduler=sched_fn)
    assert opt is made["opt"] and made["sched_opt"] is made["opt"]
    x, y = data()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.25]


def test_config_scheduler_and_lr_accessors():
    cfg = sgd_config(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                              "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, _, _, sched = make(cfg)
    assert type(sched).__name__ == "WarmupLR"
    lrs = []
    for _ in range(3):
        x, y = data()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.0, 0.025, 0.05])  # DeepSpeed: the k-th step runs at iteration k - 1
    assert engine.get_mom() == [0]  # SGD's momentum


# ---- backward and step --------------------------------------------------------------------------

def _grads(engine):
    return [p.grad.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("precision", [{}, {"fp16": {"enabled": True, "initial_scale_power": 8}}])
def test_scale_backward_equals_engine_backward(precision):
    cfg = sgd_config(gradient_accumulation_steps=2, **precision)
    dtype = torch.float16 if precision else torch.float32
    a, *_ = make(cfg)
    b, *_ = make(cfg)
    x, y = data(dtype=dtype)
    a.backward(loss_fn(a(x), y))
    loss = loss_fn(b(x), y)
    b.scale(loss).backward()
    for ga, gb in zip(_grads(a), _grads(b)):
        assert torch.equal(ga, gb)
    # and direct loss.backward() on an fp32 engine gives the same gradients too
    if not precision:
        c, *_ = make(cfg)
        loss_fn(c(x), y).backward()
        for ga, gc in zip(_grads(a), _grads(c)):
            assert torch.equal(ga, gc)


def test_backward_scales_by_gas_and_returns_scaled_loss():
    engine, *_ = make(sgd_config(gradient_accumulation_steps=4))
    ref = MLP()
    torch.manual_seed(0)
    ref = MLP()
    x, y = data()
    loss = loss_fn(engine(x), y)
    returned = engine.backward(loss)
    assert torch.allclose(returned, loss / 4)
    (loss_fn(ref(x), y) / 4).backward()
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=0, rtol=1e-6)
    engine.zero_grad()
    engine.backward(loss_fn(engine(x), y), scale_wrt_gas=False)
    ref.zero_grad()
    loss_fn(ref(x), y).backward()
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=0, rtol=1e-6)


def test_backward_rejects_non_scalar():
    engine, *_ = make(sgd_config())
    x, _ = data()
    with pytest.raises(AssertionError, match="scalar"):
        engine.backward(engine(x))


def test_gradient_accumulation_boundaries_and_counters():
    engine, *_ = make(sgd_config(gradient_accumulation_steps=3))
    applied = []
    for micro in range(6):
        x, y = data(seed=micro)
        assert engine.is_gradient_accumulation_boundary() == (micro % 3 == 2)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6 and engine.global_samples == 2 * 12
    engine.set_gradient_accumulation_boundary(True)
    x, y = data()
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.global_steps == 3
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))


def test_no_sync_rules():
    engine, *_ = make(sgd_config())
    with engine.no_sync():
        x, y = data()
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(AssertionError, match="illegal"):
            engine.step()
        with pytest.raises(AssertionError, match="reentry"):
            with engine.no_sync():
                pass
    engine.step()
    assert engine.global_steps == 1
    with pytest.raises(NotImplementedError, match="stage 0"):
        with engine.coalesce_grad_reduction():
            pass


def test_clipping_matches_clip_grad_norm_and_reports_norm():
    engine, *_ = make(sgd_config(gradient_clipping=0.01))
    torch.manual_seed(0)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    loss_fn(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    opt.step()
    assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-6)
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)


def test_params_without_grad_and_frozen_params():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(12, 3)
            self.unused = torch.nn.Linear(12, 3)
            self.frozen = torch.nn.Linear(12, 12)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.used(self.frozen(x))

    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.5}}}
    torch.manual_seed(0)
    engine, *_ = deepspeed_c.initialize(model=Branchy(), config=cfg)
    frozen_before = engine.module.frozen.weight.detach().clone()
    unused_before = engine.module.unused.weight.detach().clone()
    x, y = data()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert torch.equal(engine.module.frozen.weight, frozen_before)
    assert engine.module.frozen.weight.grad is None
    # DeepSpeed hands a zero gradient to a trainable parameter that got none: weight decay applies
    assert torch.allclose(engine.module.unused.weight, unused_before * (1 - 0.1 * 0.5))


# ---- precision ----------------------------------------------------------------------------------

def test_fp16_overflow_skips_step_and_halves_scale_after_hysteresis(log_capture):
    # the ZeRO optimizers' scaler: hysteresis, DeepSpeed's OVERFLOW lines
    cfg = sgd_config(fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 2},
                     zero_optimization={"stage": 1}, zero_allow_untested_optimizer=True)
    engine, *_ = make(cfg)
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    assert engine.optimizer.cur_scale == 1024
    x, y = data(dtype=torch.float16)

    def overflow_step():
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(loss_fn(engine(x), y) * float("inf"))  # ZeRO holds the gradients: overflow them here
        engine.step()
        for a, p in zip(before, engine.module.parameters()):
            assert torch.equal(a, p), "an overflowing step must leave the weights unchanged"
        assert not engine.was_step_applied()

    overflow_step()
    assert engine.optimizer.cur_scale == 1024  # hysteresis 2 -> 1, scale kept
    overflow_step()
    assert engine.optimizer.cur_scale == 512  # hysteresis used up: halved
    assert engine.skipped_steps == 2 and engine.global_steps == 2
    text = log_capture.getvalue()
    assert "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1024, but hysteresis is 2" in text
    assert "Attempted loss scale: 1024, reducing to 512" in text
    # a clean step applies and moves the weights
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.was_step_applied()
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))


def test_fp16_stage0_halves_at_every_overflow():
    # DeepSpeed 0.19.8's stage-0 fp16 optimizers take no hysteresis: the first overflow halves the scale
    cfg = sgd_config(fp16={"enabled": True, "initial_scale_power": 10, "hysteresis": 2})
    engine, *_ = make(cfg)
    x, y = data(dtype=torch.float16)
    for expected in (512, 256):
        engine.backward(loss_fn(engine(x), y))
        next(engine.module.parameters()).grad[0, 0] = float("inf")
        engine.step()
        assert engine.optimizer.cur_scale == expected and not engine.was_step_applied()


def test_fp16_stage0_keeps_skipping_at_the_minimum_scale():
    # DeepSpeed 0.19.8's stage-0 fp16 optimizers halve down to min_loss_scale and then keep skipping
    # overflowing steps (its ZeRO optimizers' scaler raises there instead)
    cfg = sgd_config(fp16={"enabled": True, "initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1})
    engine, *_ = make(cfg)
    x, y = data(dtype=torch.float16)
    for expected in (1, 1, 1):
        engine.backward(loss_fn(engine(x), y))
        next(engine.module.parameters()).grad[0, 0] = float("inf")
        engine.step()
        assert engine.optimizer.cur_scale == expected and not engine.was_step_applied()
    assert engine.skipped_steps == 3


def test_fp16_master_weights_track_fp32_reference():
    cfg = sgd_config(fp16={"enabled": True, "initial_scale_power": 12})
    engine, *_ = make(cfg)
    torch.manual_seed(0)
    ref = MLP().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x, y = data(seed=step)
        engine.backward(loss_fn(engine(x.half()), y.half()))
        engine.step()
        loss_fn(ref(x.double()), y.double()).backward()
        opt.step()
        opt.zero_grad()
    masters = [m for g in engine.optimizer.fp32_groups for m in g]
    for m, q in zip(masters, ref.parameters()):
        assert m.dtype == torch.float32
        assert float((m.detach().double() - q.detach()).norm() / q.detach().norm()) < 5e-3


def test_fp16_direct_backward_without_scale_raises():
    engine, *_ = make(sgd_config(fp16={"enabled": True}))
    x, y = data(dtype=torch.float16)
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        loss_fn(engine(x), y).backward()


def test_bf16_run_trains():
    engine, *_ = make({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
                       "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}}})
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    x, y = data(n=8, dtype=torch.bfloat16)
    losses = []
    for _ in range(30):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert all(m.dtype == torch.float32 for g in engine.optimizer.fp32_groups for m in g)
    assert engine.get_global_grad_norm() is not None


def test_torch_autocast_forward():
    from deepspeed_c.runtime.torch_autocast import get_comm_dtype, is_autocast_initialized

    engine, *_ = make(sgd_config(torch_autocast={"enabled": True, "dtype": "bfloat16"}))
    assert is_autocast_initialized() and get_comm_dtype(engine.module.net[0].weight) == torch.bfloat16
    x, y = data()
    out = engine(x)
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    engine.backward(loss_fn(out.float(), y))
    engine.step()
    assert engine.global_steps == 1


# ---- accessors and plumbing ----------------------------------------------------------------------

def test_accessors():
    engine, *_ = make(sgd_config(gradient_accumulation_steps=2, fp16={"enabled": True, "loss_scale": 64}))
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 8 and engine.get_batch_info() == (8, 4, 2)
    assert engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.loss_scale() == 64 and not engine.dynamic_loss_scale()
    assert engine.communication_data_type == torch.float16
    assert engine.global_rank == 0 and engine.world_size == 1 and engine.local_rank == 0
    assert engine.device == torch.device("cpu")
    engine.set_train_batch_size(16)
    assert engine.gradient_accumulation_steps() == 4
    engine.set_train_micro_batch_size(2)
    assert engine.train_batch_size() == 8
    with pytest.raises(ValueError):
        engine.set_train_batch_size(3)
    assert engine.net is engine.module.net  # attributes fall through to the model
    with pytest.raises(AttributeError):
        engine.no_such_attribute


def test_steps_per_print_line(log_capture):
    engine, *_ = make(sgd_config(steps_per_print=2))
    for _ in range(4):
        x, y = data()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    lines = [line for line in log_capture.getvalue().splitlines() if line.startswith("[Rank 0] step=")]
    assert [line.split(",")[0] for line in lines] == ["[Rank 0] step=0", "[Rank 0] step=2", "[Rank 0] step=4"]
    lines = lines[1:]
    assert "lr=[0.1]" in lines[0] and "loss=" in lines[0] and "samples/sec=" in lines[0]


def test_deepspeed_io_and_destroy():
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 12), torch.randn(16, 3))
    engine, _, loader, _ = make(sgd_config(), training_data=dataset)
    assert loader is engine.training_dataloader
    x, y = next(iter(loader))
    assert x.shape == (4, 12)
    engine.destroy()
    engine.destroy()


def test_monitor_events_and_wall_clock_timers(tmp_path):
    cfg = sgd_config(wall_clock_breakdown=True, fp16={"enabled": True, "initial_scale_power": 4},
                     csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    engine, *_ = make(cfg)
    x, y = data(dtype=torch.float16)
    for _ in range(3):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    files = {p.name: p.read_text().splitlines() for p in (tmp_path / "job").iterdir()}
    lr_file = next(name for name in files if "lr" in name)
    assert files[lr_file][0] == "step,lr" and [row.split(",")[0] for row in files[lr_file][1:]] == ["4", "8", "12"]
    assert any("loss_scale" in name for name in files) and any("train_loss" in name for name in files)
    assert any("elapsed_time_ms_forward" in name for name in files)
    timers = engine.get_wall_clock_timers()
    assert {"fwd_microstep", "bwd_microstep", "step_microstep", "fwd", "bwd", "step"} <= set(timers)


def test_optimizer_and_scheduler_params_are_validated_against_their_class():
    with pytest.raises(ValueError, match=r"optimizer\.params\.lrr.*Did you mean 'lr'"):
        make({"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lrr": 0.1}}})
    with pytest.raises(ValueError, match=r"scheduler\.params"):
        make(sgd_config(scheduler={"type": "WarmupLR", "params": {"warmup_max": 0.1}}))


def test_lamb_on_cpu_is_the_torch_implementation():
    engine, opt, _, _ = make({"train_batch_size": 4, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}}})
    assert type(opt).__name__ == "CPULamb"
    x, y = data()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert len(opt.get_lamb_coeffs()) == len(list(engine.module.parameters()))
