"""ZeRO's fit check at initialize (runtime/zero/fit_check.py): lower bounds of the model-state bytes per
rank, worked by hand for each stage, and the refusal naming the figures (device and host bytes needed vs
available) when they exceed the device or the host, at initialize, before any step."""
import pytest
import torch

from deepspeed_c.runtime.zero import fit_check

B = 1_000_000_000


def test_bounds_per_stage_bf16_adam():
    # 1B params, all trainable, largest layer 50M, 8 ranks (4 a node), bf16 weights, Adam (8 bytes of moments)
    z3 = fit_check.lower_bounds(3, B, B, 50_000_000, 8, 4, 2, 8, None, None)
    assert (z3.weights, z3.gradients, z3.optimizer, z3.host) == (2 * B // 8 + 100_000_000, 2 * B // 8, 12 * B // 8, 0)
    z2 = fit_check.lower_bounds(2, B, B, 0, 8, 4, 2, 8, None, None)
    assert (z2.weights, z2.gradients, z2.optimizer) == (2 * B, 2 * B // 8, 12 * B // 8)
    z1 = fit_check.lower_bounds(1, B, B, 0, 8, 4, 2, 8, None, None)
    assert (z1.weights, z1.gradients, z1.optimizer) == (2 * B, 2 * B, 12 * B // 8)
    z0 = fit_check.lower_bounds(0, B, B, 0, 8, 4, 2, 8, None, None)
    assert z0.device == 2 * B + 2 * B + 12 * B


def test_offload_moves_states_to_the_host():
    off = fit_check.lower_bounds(3, B, B // 2, 10, 8, 4, 2, 8, "cpu", "cpu")
    assert off.weights == 20 and off.gradients == 0 and off.optimizer == 0
    assert off.host == (B // 2) * 12 * 4 // 8 + B * 2 * 4 // 8
    nvme = fit_check.lower_bounds(3, B, B, 10, 8, 4, 2, 8, "nvme", "nvme")
    assert nvme.device == 20 and nvme.host == 0


def test_fp32_weights_have_no_separate_master():
    z1 = fit_check.lower_bounds(1, 100, 100, 0, 1, 1, 4, 8, None, None)
    assert z1.optimizer == 800 and z1.weights == 400 and z1.gradients == 400


def test_refusal_names_the_figures_and_the_remedy():
    need = fit_check.lower_bounds(3, 70 * B, 70 * B, 1_000_000_000, 2, 2, 2, 8, None, None)
    with pytest.raises(fit_check.ModelDoesNotFitError) as e:
        fit_check.check(need, 3, 70 * B, device_capacity=80 * (1 << 30), host_capacity=None)
    msg = str(e.value)
    assert "zero_optimization.stage=3" in msg and "70.00B" in msg and "80.00 GiB" in msg
    assert "offload_optimizer" in msg and "nvme" in msg
    fit_check.check(need, 3, 70 * B, device_capacity=None, host_capacity=None)  # CPU ranks: not checked
    small = fit_check.lower_bounds(3, B, B, 1000, 2, 2, 2, 8, None, None)
    fit_check.check(small, 3, B, device_capacity=80 * (1 << 30), host_capacity=None)


GIB = 1 << 30


def test_even_with_offload_the_host_shortfall_names_both_figures():
    """Issue 48's bad input: 70B with optimizer and parameter offload to the host fits the device but needs
    70e9 * (12 + 2) bytes of host memory per node of 8 ranks, far above 512 GiB."""
    need = fit_check.lower_bounds(3, 70 * B, 70 * B, 500_000_000, 8, 8, 2, 8, "cpu", "cpu")
    assert need.host == 70 * B * 12 + 70 * B * 2 and need.device == 1_000_000_000
    with pytest.raises(fit_check.ModelDoesNotFitError) as e:
        fit_check.check(need, 3, 70 * B, device_capacity=80 * GIB, host_capacity=512 * GIB,
                        offload_optimizer="cpu", offload_param="cpu")
    msg = str(e.value)
    assert "host: at least 912.70 GiB" in msg and "vs 512.00 GiB of host memory" in msg, msg
    assert "device: at least 0.93 GiB per rank" in msg and "vs 80.00 GiB the device has" in msg, msg
    assert '"nvme" instead of "cpu"' in msg and "offload the optimizer" not in msg, msg
    # the same on NVMe: no host bound, device fits
    fit_check.check(fit_check.lower_bounds(3, 70 * B, 70 * B, 500_000_000, 8, 8, 2, 8, "nvme", "nvme"), 3, 70 * B,
                    device_capacity=80 * GIB, host_capacity=512 * GIB, offload_optimizer="nvme", offload_param="nvme")


def test_everything_offloaded_and_the_largest_layer_too_big_for_the_device():
    need = fit_check.lower_bounds(3, 10 * B, 10 * B, 5 * B, 1, 1, 2, 8, "nvme", "nvme")
    with pytest.raises(fit_check.ModelDoesNotFitError) as e:
        fit_check.check(need, 3, 10 * B, device_capacity=8 * GIB, host_capacity=None, offload_optimizer="nvme",
                        offload_param="nvme")
    msg = str(e.value)
    assert "weights 9.31 GiB" in msg and "vs 8.00 GiB the device has" in msg, msg
    assert "host:" not in msg, msg  # NVMe: no host bound
    assert "everything is offloaded already" in msg and "offload the" not in msg, msg


@pytest.mark.usefixtures("world_of_one")
def test_initialize_refuses_before_any_step(monkeypatch):
    """End to end on the host: a ZeRO-Offload engine whose offloaded states exceed the host (its reading made
    small here; this machine has no device-memory reading) is refused by initialize with the figures."""
    import deepspeed_c

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    n = sum(p.numel() for p in model.parameters())  # 131,584 fp32: 12 bytes each offloaded (master, moments)
    monkeypatch.setattr(fit_check, "host_capacity", lambda: 1 << 20)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(fit_check.ModelDoesNotFitError) as e:
        deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    msg = str(e.value)
    assert "zero_optimization.stage=2" in msg and f"host: at least {n * 12 / (1 << 20):.2f} MiB" in msg, msg
    assert "vs 1.00 MiB of host memory" in msg and "nvme" in msg, msg
    monkeypatch.setattr(fit_check, "host_capacity", lambda: 1 << 30)  # 1 GiB is enough: it trains
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg, model_parameters=model.parameters())
    engine.backward(engine(torch.randn(1, 256)).sum())
    engine.step()


def test_optimizer_state_bytes():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert fit_check.optimizer_state_bytes(torch.optim.AdamW(p)) == 8
    assert fit_check.optimizer_state_bytes(torch.optim.SGD(p, lr=0.1)) == 0


@pytest.mark.usefixtures("world_of_one")
def test_initialize_without_optimizer_checks_the_weights_alone(monkeypatch):
    """Stage 3 without an optimizer (ZeRO-Inference through initialize): the offloaded weights are checked
    against the host, no optimizer states counted."""
    import deepspeed_c

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(fit_check, "host_capacity", lambda: 1 << 10)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with pytest.raises(fit_check.ModelDoesNotFitError) as e:
        deepspeed_c.initialize(model=model, config=cfg)
    assert f"host: at least {n * 4 / (1 << 20):.2f} MiB" in str(e.value), str(e.value)  # fp32 weights, 4 bytes each
    monkeypatch.setattr(fit_check, "host_capacity", lambda: n * 4)  # exactly enough
    engine, *_ = deepspeed_c.initialize(model=model, config=cfg)
    with torch.no_grad():
        assert engine(torch.randn(1, 256)).shape == (1, 256)
