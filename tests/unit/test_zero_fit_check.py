"""ZeRO's fit check at initialize (runtime/zero/fit_check.py): lower bounds of the model-state bytes per
rank, worked by hand for each stage, and the refusal naming the figures when they exceed the device."""
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


def test_optimizer_state_bytes():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert fit_check.optimizer_state_bytes(torch.optim.AdamW(p)) == 8
    assert fit_check.optimizer_state_bytes(torch.optim.SGD(p, lr=0.1)) == 0
