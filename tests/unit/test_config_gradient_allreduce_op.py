"""`gradient_allreduce_op` parsing as DeepSpeed 0.19.8's DeepSpeedConfig (issue 49 items 4 and 5; the
scenarios of its tests/unit/runtime/test_ds_config_dict.py): "mean"/"sum" case-insensitively, "mean"
by default, anything else a ValueError worded as DeepSpeed's ("Invalid gradient_allreduce_op ...",
so code matching its message keeps working), and "sum" refused with ZeRO stage 3, ZenFlow and
DeepCompile with DeepSpeed's ValueError. Training with "sum" at stages 0-2 is checked against PyTorch
in tests/distributed/test_gradient_allreduce_op.py."""
from __future__ import annotations

import pytest

from deepspeed_c.runtime.config import DeepSpeedConfig


@pytest.mark.parametrize("value,expected", [("mean", "mean"), ("SUM", "sum"), ("Mean", "mean")])
def test_values_are_lowercased(value, expected):
    assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": value}).gradient_allreduce_op == expected


def test_default_is_mean():
    assert DeepSpeedConfig({"train_batch_size": 1}).gradient_allreduce_op == "mean"


@pytest.mark.parametrize("value", ["max", "avg", 1, None])
def test_invalid_value_uses_deepspeeds_wording(value):
    with pytest.raises(ValueError, match=r"^Invalid gradient_allreduce_op\. Supported operations: \['mean', 'sum'\]\. "
                                         r"Got: ") as e:
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": value})
    assert repr(value) in str(e.value)


def test_sum_is_refused_with_zero_stage_3():
    with pytest.raises(ValueError, match="not supported with ZeRO stage 3"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})


def test_mean_is_accepted_with_zero_stage_3():
    cfg = DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "MEAN", "zero_optimization": {"stage": 3}})
    assert cfg.gradient_allreduce_op == "mean"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sum_is_accepted_below_stage_3(stage):
    cfg = DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": stage}})
    assert cfg.gradient_allreduce_op == "sum"


def test_sum_is_refused_with_zenflow():
    with pytest.raises(ValueError, match="not supported with ZenFlow"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum",
                         "zero_optimization": {"stage": 2, "zenflow": {}}})


@pytest.mark.parametrize("stage", [1, 2])
def test_sum_is_refused_with_deepcompile(stage):
    with pytest.raises(ValueError, match="not supported with DeepCompile"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": stage},
                         "compile": {"deepcompile": True}})
