"""zero_optimization.zenflow and offload_optimizer.super_offload as DeepSpeed 0.19.8 parses them: keys,
defaults, the schedule configure_zenflow resolves, and bad input raising with the key named."""
from __future__ import annotations

import pytest

from deepspeed_c.runtime.config.utils import DeepSpeedConfigError
from deepspeed_c.runtime.config.zero import parse_zero_config
from deepspeed_c.runtime.zenflow.zenflow_config import ZenFlowConfig, resolve_schedule

OFF = {"device": "cpu"}


def _zero(**kw):
    return parse_zero_config({"zero_optimization": kw})


def test_defaults_and_dict_coercion():
    cfg = _zero(stage=2, offload_optimizer=OFF, zenflow={})
    z = cfg.zenflow
    assert isinstance(z, ZenFlowConfig)
    assert (z.topk_ratio, z.select_strategy, z.select_interval, z.update_interval, z.overlap_step, z.offload,
            z.auto_ratio, z.full_warm_up_rounds, z.pt_reserved_cores_perc, z.steps_per_epoch) == (
        0.1, "auto", "auto", "auto", False, False, 0.99, 0, 0.5, None)
    cfg = _zero(stage=1, offload_optimizer=OFF, zenflow={"topk_ratio": 0.25, "select_strategy": "epoch",
                                                         "select_interval": 3, "update_interval": 6,
                                                         "full_warm_up_rounds": 1, "overlap_step": True})
    assert cfg.zenflow.select_interval == 3 and cfg.zenflow.overlap_step is True


def test_schedule_as_configure_zenflow():
    s = resolve_schedule(ZenFlowConfig())  # auto: epoch-based, epoch length unknown -> select once
    assert (s.select_interval, s.update_interval, s.auto_update) == (0, 0, True)
    s = resolve_schedule(ZenFlowConfig(), steps_per_epoch=50)
    assert s.select_interval == 50
    s = resolve_schedule(ZenFlowConfig(select_strategy="step", select_interval=8, update_interval=4))
    assert (s.select_interval, s.update_interval, s.auto_update) == (8, 4, False)
    with pytest.raises(ValueError, match="Select interval must be greater or equal to update interval"):
        resolve_schedule(ZenFlowConfig(select_strategy="step", select_interval=2, update_interval=4))


@pytest.mark.parametrize("zen,match", [
    ({"topk_ratio": 1.5}, r"zero_optimization\.zenflow\.topk_ratio.*less than 1"),
    ({"topk_ratio": 1.0}, r"zero_optimization\.zenflow\.topk_ratio.*less than 1"),  # (0, 1) open, as DeepSpeed's
    ({"topk_ratio": 0}, r"zero_optimization\.zenflow\.topk_ratio.*greater than 0"),
    ({"topk_ratio": -0.1}, r"zero_optimization\.zenflow\.topk_ratio.*greater than 0"),
    ({"update_interval": 0}, r"zero_optimization\.zenflow.*update_interval must be"),
    ({"update_interval": "sometimes"}, r"zero_optimization\.zenflow.*update_interval is a string, it must be"),
    ({"select_strategy": "often"}, r"zero_optimization\.zenflow.*select_strategy must be one of"),
    ({"select_strategy": "step"}, r"zero_optimization\.zenflow.*select_interval must be a number"),
    ({"select_interval": 4}, r"zero_optimization\.zenflow.*select_interval would be overwritten"),
    ({"topk": 0.2}, r"Unknown config key 'zero_optimization\.zenflow\.topk'.*topk_ratio"),
])
def test_bad_zenflow_values_name_the_key(zen, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        _zero(stage=2, offload_optimizer=OFF, zenflow=zen)


def test_zenflow_without_offload_optimizer():
    with pytest.raises(DeepSpeedConfigError, match=r"Zenflow must be used with cpu offload.*"
                                                   r"zero_optimization\.offload_optimizer\.device"):
        _zero(stage=2, zenflow={})
    with pytest.raises(DeepSpeedConfigError, match="Zenflow must be used with cpu offload"):
        _zero(stage=2, offload_optimizer={"device": "none"}, zenflow={})


def test_zenflow_at_stage_0_is_refused():
    with pytest.raises(NotImplementedError, match=r"zero_optimization\.(zenflow|offload_optimizer)"):
        _zero(stage=0, offload_optimizer=OFF, zenflow={})


@pytest.mark.parametrize("stage", [1, 2])
def test_super_offload_below_stage_3(stage):
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization\.offload_optimizer\.super_offload' needs "
                                                   r"ZeRO stage 3"):
        _zero(stage=stage, offload_optimizer={"device": "cpu", "super_offload": True})


def test_super_offload_keys_at_stage_3():
    cfg = _zero(stage=3, offload_optimizer={"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.5})
    assert cfg.offload_optimizer.super_offload is True and cfg.offload_optimizer.cpuadam_cores_perc == 0.5
    with pytest.raises(DeepSpeedConfigError, match=r"offload_optimizer\.cpuadam_cores_perc"):
        _zero(stage=3, offload_optimizer={"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 1.5})


def test_zenflow_offload_and_super_offload_combinations():
    with pytest.raises(NotImplementedError, match=r"zero_optimization\.zenflow\.offload"):
        _zero(stage=2, offload_optimizer=OFF, zenflow={"offload": True})
    with pytest.raises(DeepSpeedConfigError, match="cannot be used together"):
        _zero(stage=3, offload_optimizer={"device": "cpu", "super_offload": True}, zenflow={})
    assert _zero(stage=3, offload_optimizer=OFF, zenflow={}).zenflow is not None  # stage 3 is built
