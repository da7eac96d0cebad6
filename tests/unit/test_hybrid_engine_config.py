"""The `hybrid_engine` section: DeepSpeed 0.19.8's keys and defaults, bad values named by their key path."""
import pytest

from deepspeed_c.runtime.config import DeepSpeedConfig


def _cfg(**he):
    return {"train_batch_size": 2, "hybrid_engine": he}


def test_defaults_are_deepspeeds():
    he = DeepSpeedConfig(_cfg(enabled=True)).hybrid_engine
    assert he.model_dump() == {"enabled": True, "max_out_tokens": 512, "inference_tp_size": 1,
                               "release_inference_cache": False, "pin_parameters": True,
                               "tp_gather_partition_size": 8, "enable_cuda_graph": False}
    assert DeepSpeedConfig({"train_batch_size": 2}).hybrid_engine.enabled is False


@pytest.mark.parametrize("he, match", [
    ({"enabled": True, "max_out_token": 4}, "hybrid_engine.max_out_token"),
    ({"enabled": True, "tp_gather_partition_size": 0}, "hybrid_engine"),
    ({"enabled": True, "inference_tp_size": 2}, "'hybrid_engine.inference_tp_size'.*world size \\(1\\)"),
])
def test_bad_values_name_the_key(he, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedConfig(_cfg(**he))
