"""ZeRO++'s config keys: DeepSpeed's names and defaults, accepted at stage 3; below stage 3 accepted with a
warning naming them (DeepSpeed's stage 1/2 never reads them); qgZ without the reduce-scatter it replaces
refused with the key named."""
from __future__ import annotations

import pytest

from deepspeed_c.runtime.config.zero import parse_zero_config

KEYS = {"zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True,
        "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}


def test_defaults_and_stage3_accepts_every_key() -> None:
    d = parse_zero_config({"zero_optimization": {"stage": 3}})
    assert (d.zero_quantized_weights, d.zero_quantized_nontrainable_weights, d.zero_quantized_gradients,
            d.zero_hpz_partition_size) == (False, False, False, 1)
    c = parse_zero_config({"zero_optimization": {"stage": 3, **KEYS}})
    assert (c.zero_quantized_weights, c.zero_quantized_gradients, c.zero_hpz_partition_size) == (True, True, 8)


@pytest.mark.parametrize("key", sorted(KEYS))
def test_below_stage3_warns_naming_the_key(key: str) -> None:
    # DeepSpeed's stage 1/2 never reads the ZeRO++ keys: accepted with a warning that they have no effect
    with pytest.warns(UserWarning, match=f"zero_optimization.{key}.*no effect at ZeRO stage 2"):
        c = parse_zero_config({"zero_optimization": {"stage": 2, key: KEYS[key]}})
    assert c.stage == 2


def test_qgz_without_reduce_scatter_and_loco_raise() -> None:
    with pytest.raises(NotImplementedError, match="zero_optimization.zero_quantized_gradients"):
        parse_zero_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                 "reduce_scatter": False}})
    # LoCo is qgZ's error feedback: without qgZ it is refused, naming the key
    with pytest.raises(ValueError, match="zero_optimization.zeropp_loco_param"):
        parse_zero_config({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}})
    with pytest.raises(ValueError, match="zeropp_loco_param.err_beta"):
        parse_zero_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                 "zeropp_loco_param": {"err_beta": 1.5}}})
    with pytest.raises(ValueError, match="zeropp_loco_param: unknown keys"):
        parse_zero_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                 "zeropp_loco_param": {"err_beta": 0.8, "reset": 5}}})
    parse_zero_config({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                             "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}})
