"""The engine's legacy curriculum and progressive layer drop, one process: DeepSpeed's accessors read the
config, a custom schedule set through set_custom_curriculum_learning_schedule reaches the forward, and bad
sections fail at initialize naming the key. (The values against DeepSpeed, on 2 ranks and across a resume:
tests/distributed/test_data_efficiency_forward.py.)"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import deepspeed_c

pytestmark = pytest.mark.usefixtures("world_of_one")  # in-process initialize: no process group leaks


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor, curriculum_seqlen: Optional[int] = None, **kw) -> torch.Tensor:
        self.seen.append((curriculum_seqlen, kw.get("pld_theta")))
        return self.lin(x).pow(2).mean()


def _cfg(**sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **sections}


def _curriculum(**over) -> dict:
    c = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
         "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}
    c.update(over)
    return c


def _train(engine, steps: int) -> None:
    for _ in range(steps):
        loss = engine(torch.ones(2, 3))
        engine.backward(loss)
        engine.step()


def test_accessors_and_custom_schedule():
    net = Net()
    engine, *_ = deepspeed_c.initialize(model=net, config=_cfg(curriculum_learning=_curriculum(schedule_type="custom")))
    try:
        assert engine.curriculum_enabled_legacy() is True
        assert engine.curriculum_params_legacy()["curriculum_type"] == "seqlen"
        assert "enabled" not in engine.curriculum_params_legacy()
        assert engine.pld_enabled() is False and engine.get_pld_theta() is None
        assert engine.progressive_layer_drop is None
        assert engine.curriculum_scheduler is engine.curriculum_scheduler_legacy
        engine.set_custom_curriculum_learning_schedule({"seqlen": lambda step: 8 * step})
        _train(engine, 4)
        # the forward at global_steps g asks for step g + 1; the custom function is 8 * step
        assert [s for s, _ in net.seen] == [8, 16, 24, 32]
        assert all(t is None for _, t in net.seen)
    finally:
        engine.destroy()


def test_disabled_sections_pass_nothing():
    net = Net()
    engine, *_ = deepspeed_c.initialize(model=net, config=_cfg(
        curriculum_learning=_curriculum(enabled=False), progressive_layer_drop={"enabled": False, "theta": 0.3}))
    try:
        assert engine.curriculum_enabled_legacy() is False and engine.curriculum_scheduler is None
        _train(engine, 2)
        assert net.seen == [(None, None), (None, None)]
        with pytest.raises(RuntimeError, match="curriculum_learning.enabled"):
            engine.set_custom_curriculum_learning_schedule(lambda s: s)
    finally:
        engine.destroy()


def test_pld_theta_decays_from_one():
    net = Net()
    engine, *_ = deepspeed_c.initialize(model=net, config=_cfg(
        progressive_layer_drop={"enabled": True, "theta": 0.5, "gamma": 0.1}))
    try:
        assert engine.get_pld_theta() == 1.0
        _train(engine, 3)
        thetas = [t for _, t in net.seen]
        assert thetas[0] == 1.0 and thetas[1] == 1.0  # updated with step 0 at the first boundary: exp(0)
        assert thetas[2] == pytest.approx(0.5 * torch.exp(torch.tensor(-0.1, dtype=torch.float64)).item() + 0.5,
                                          abs=1e-15)
    finally:
        engine.destroy()


@pytest.mark.parametrize("section, key", [
    (_curriculum(schedule_type="fixed_cubic"), "curriculum_learning.schedule_type"),
    (_curriculum(min_difficulty=128), "curriculum_learning.min_difficulty"),
    (_curriculum(curriculum_type="vocab_rarity"), "curriculum_learning.curriculum_type"),
    (_curriculum(schedule_type="fixed_root"), "curriculum_learning.schedule_config.root_degree"),
    (_curriculum(schedule_config={"difficulty_step": 8}), "curriculum_learning.schedule_config.total_curriculum_step"),
    (_curriculum(enabled="yes"), "curriculum_learning.enabled"),
])
def test_bad_curriculum_fails_at_initialize_naming_the_key(section, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        deepspeed_c.initialize(model=Net(), config=_cfg(curriculum_learning=section))


def test_custom_without_function_says_what_to_call():
    cfg = _cfg(curriculum_learning=_curriculum(schedule_type="custom"))
    engine, *_ = deepspeed_c.initialize(model=Net(), config=cfg)
    try:
        with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
            engine(torch.ones(2, 3))
    finally:
        engine.destroy()
